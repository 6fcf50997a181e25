// GPU kernel of UcudnnProfileConvolution (see profile_ops.cc), and of UcudnnCudnnVersion.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/conv/conv_attrs.h"
#include "cc/conv/conv_op_kernel.h"
#include "cc/cudnn/convolution.h"
#include "cc/cudnn/engines.h"
#include "cc/cudnn/op_kernel_resources.h"
#include "cc/cudnn/types.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tf_ucudnn {

template <typename T>
class ProfileConvolutionOp : public tensorflow::OpKernel {
 public:
  explicit ProfileConvolutionOp(tensorflow::OpKernelConstruction* ctx)
      : tensorflow::OpKernel(ctx) {
    std::vector<int32_t> strides;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("strides", &strides));
    OP_REQUIRES(ctx, strides.size() == 4 || strides.size() == 5,
                absl::InvalidArgumentError("strides must have 4 or 5 entries"));
    OP_REQUIRES_OK(ctx, ReadConvAttrs(ctx, static_cast<int>(strides.size()) - 2, &attrs_));
    std::string kernel;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kernel", &kernel));
    kernel_ = kernel == "fwd"        ? ConvKernel::kForward
              : kernel == "bwd_data" ? ConvKernel::kBackpropInput
                                     : ConvKernel::kBackpropFilter;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("batch_sizes", &batch_sizes_));
    std::string candidates;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("candidates", &candidates));
    candidates_ = candidates == "engines" ? ProfiledCandidates::kEngines
                                          : ProfiledCandidates::kLegacy;
    std::string form;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("form", &form));
    OP_REQUIRES(ctx, FormFromName(form, &form_),
                absl::InvalidArgumentError(absl::StrCat("unknown form '", form, "'")));
    int64_t limit = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("workspace_limit", &limit));
    OP_REQUIRES(ctx, limit >= 0, absl::InvalidArgumentError("workspace_limit must be >= 0"));
    workspace_limit_ = static_cast<size_t>(limit);
  }

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& input = ctx->input(0);
    const tensorflow::Tensor& filter = ctx->input(1);
    const tensorflow::Tensor& out_backprop = ctx->input(2);
    ConvGeometry geometry;
    absl::Status status =
        ComputeConvGeometry(attrs_, Dims(input.shape()), Dims(filter.shape()), &geometry);
    if (status.ok()) status = CheckOutputShape(geometry, Dims(out_backprop.shape()));
    if (status.ok()) status = CheckForm(geometry, form_);
    std::vector<AlgorithmMeasurement> measurements;
    if (status.ok()) {
      const ConvBuffers<void> buffers{const_cast<T*>(input.flat<T>().data()),
                                      const_cast<T*>(filter.flat<T>().data()),
                                      const_cast<T*>(out_backprop.flat<T>().data())};
      OpKernelResources resources(ctx);
      status = CudnnConvolution(&resources, kernel_, geometry, CudnnDataType<T>::value, buffers,
                                form_)
                   .Profile(batch_sizes_, workspace_limit_, candidates_, &measurements);
    }
    OP_REQUIRES(ctx, status.ok(),
                absl::Status(status.code(), absl::StrCat(type_string(), " '", name(), "' (",
                                                         KernelName(kernel_), " kernel): ",
                                                         status.message())));
    const int64_t count = static_cast<int64_t>(measurements.size());
    tensorflow::Tensor* table = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({count, 4}), &table));
    tensorflow::Tensor* algorithms = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tensorflow::TensorShape({count}), &algorithms));
    auto rows = table->matrix<double>();
    auto texts = algorithms->vec<tensorflow::tstring>();
    for (int64_t i = 0; i < count; ++i) {
      const AlgorithmMeasurement& m = measurements[i];
      rows(i, 0) = static_cast<double>(m.batch);
      rows(i, 1) = m.time_ms;
      rows(i, 2) = static_cast<double>(m.workspace);
      rows(i, 3) = m.deterministic ? 1.0 : 0.0;
      texts(i) = m.algorithm.ToString();
    }
  }

 private:
  ConvAttrs attrs_;
  ConvKernel kernel_ = ConvKernel::kForward;
  std::vector<int64_t> batch_sizes_;
  size_t workspace_limit_ = 0;
  ProfiledCandidates candidates_ = ProfiledCandidates::kLegacy;
  ConvForm form_ = ConvForm::kDirect;
};

// The tensors stay on the GPU; the small result table is written by the host.
#define REGISTER_PROFILE_GPU(T)                                     \
  REGISTER_KERNEL_BUILDER(Name("UcudnnProfileConvolution")          \
                              .Device(tensorflow::DEVICE_GPU)       \
                              .TypeConstraint<T>("T")               \
                              .HostMemory("measurements")           \
                              .HostMemory("algorithms"),            \
                          ProfileConvolutionOp<T>);

REGISTER_PROFILE_GPU(Eigen::half);
REGISTER_PROFILE_GPU(tensorflow::bfloat16);
REGISTER_PROFILE_GPU(float);
REGISTER_PROFILE_GPU(double);

class CudnnVersionOp : public tensorflow::OpKernel {
 public:
  using tensorflow::OpKernel::OpKernel;
  void Compute(tensorflow::OpKernelContext* ctx) override {
    tensorflow::Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &output));
    output->scalar<int64_t>()() = static_cast<int64_t>(cudnnGetVersion());
  }
};

class EnginesAvailableOp : public tensorflow::OpKernel {
 public:
  using tensorflow::OpKernel::OpKernel;
  void Compute(tensorflow::OpKernelContext* ctx) override {
    tensorflow::Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &output));
    output->scalar<bool>()() = EnginesAvailable();
  }
};

// Host queries: they run on the CPU device, but exist only where the cuDNN kernels were built.
REGISTER_KERNEL_BUILDER(Name("UcudnnCudnnVersion").Device(tensorflow::DEVICE_CPU),
                        CudnnVersionOp);
REGISTER_KERNEL_BUILDER(Name("UcudnnEnginesAvailable").Device(tensorflow::DEVICE_CPU),
                        EnginesAvailableOp);

}  // namespace tf_ucudnn

#endif  // GOOGLE_CUDA
