// CPU kernels of the fused ops: the convolution is UcudnnConv2D's / UcudnnConv3D's own CPU kernel
// (the same micro-batch loop, plan checks and messages), built from this node's attributes; the
// bias and the activation are then applied to its output in place.
#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "cc/fused_conv/fused_conv_attrs.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_ucudnn {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

// Half and bfloat16 add in float and round once, as TensorFlow's BiasAdd does.
template <typename T>
using Accum = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The convolution's kernel for this node: its op type, the node's attributes but the activation,
// and its first two inputs.
absl::Status CreateConvolutionKernel(OpKernelConstruction* ctx, const std::string& op_type,
                                     std::unique_ptr<OpKernel>* kernel) {
  tensorflow::NodeDef def = ctx->def();
  def.set_op(op_type);
  def.mutable_attr()->erase("activation");
  while (def.input_size() > 2) def.mutable_input()->RemoveLast();
  const tensorflow::OpDef* op_def = nullptr;
  TF_RETURN_IF_ERROR(tensorflow::OpRegistry::Global()->LookUpOpDef(op_type, &op_def));
  tensorflow::AddDefaultsToNodeDef(*op_def, &def);
  absl::Status status;
  *kernel = tensorflow::CreateOpKernel(
      ctx->device_type(), ctx->device(),
      ctx->device()->GetAllocator(tensorflow::AllocatorAttributes()), def,
      ctx->graph_def_version(), &status);
  return status;
}

template <typename T, int kNumSpatialDims>
class UcudnnFusedConvCpuOp : public OpKernel {
 public:
  explicit UcudnnFusedConvCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string activation, data_format;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &activation));
    OP_REQUIRES_OK(ctx, Describe(ParseActivation(activation, &activation_)));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &data_format));
    channels_last_ = data_format.back() == 'C';
    OP_REQUIRES_OK(ctx, Describe(CreateConvolutionKernel(
                            ctx, absl::StrCat("UcudnnConv", kNumSpatialDims, "D"),
                            &convolution_)));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& filter = ctx->input(1);
    const Tensor& bias = ctx->input(2);
    // A filter of the wrong rank is the convolution's to report.
    const int64_t out_channels =
        filter.dims() == kNumSpatialDims + 2 ? filter.dim_size(kNumSpatialDims + 1) : -1;
    OP_REQUIRES_OK(ctx, Describe(CheckBias(bias.dims(), bias.dims() == 1 ? bias.dim_size(0) : -1,
                                           out_channels, bias.shape().DebugString())));
    convolution_->Compute(ctx);
    if (!ctx->status().ok()) return;
    AddBiasAndActivate(ctx, bias, ctx->mutable_output(0));
  }

 private:
  absl::Status Describe(const absl::Status& status) const {
    if (status.ok()) return status;
    return absl::Status(status.code(),
                        absl::StrCat(type_string(), " '", name(), "': ", status.message()));
  }

  // y = activation(y + bias[channel]) over the whole output, as rows of one channel's values
  // (channels-first: a sample's spatial positions) or of all channels (channels-last).
  void AddBiasAndActivate(OpKernelContext* ctx, const Tensor& bias, Tensor* output) const {
    using A = Accum<T>;
    const int64_t channels = bias.NumElements();
    const int64_t total = output->NumElements();
    if (total == 0) return;
    const int64_t run = channels_last_ ? 1 : total / (output->dim_size(0) * channels);
    const T* b = bias.flat<T>().data();
    T* y = output->flat<T>().data();
    const bool relu = activation_ == FusedActivation::kRelu;
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        A value = static_cast<A>(y[i]) + static_cast<A>(b[(i / run) % channels]);
        if (relu) value = std::max(value, A(0));
        y[i] = static_cast<T>(value);
      }
    };
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(total, /*cost=*/4, work);
  }

  FusedActivation activation_ = FusedActivation::kRelu;
  bool channels_last_ = true;
  std::unique_ptr<OpKernel> convolution_;
};

}  // namespace

#define REGISTER_CPU(T)                                                                     \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("UcudnnFusedConv2D").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),      \
      (UcudnnFusedConvCpuOp<T, 2>));                                                        \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("UcudnnFusedConv3D").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),      \
      (UcudnnFusedConvCpuOp<T, 3>));

REGISTER_CPU(Eigen::half);
REGISTER_CPU(tensorflow::bfloat16);
REGISTER_CPU(float);
REGISTER_CPU(double);

}  // namespace tf_ucudnn
