// GPU kernels of the fused ops: the forward convolution's attributes, plans and geometry read as
// UcudnnConv2D's kernel reads them (cc/conv/), then the plan's micro-batches run as fused cuDNN
// calls (cudnn_fused_convolution.h) on TensorFlow's stream, with its temporaries.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/conv/conv_attrs.h"
#include "cc/conv/conv_op_kernel.h"
#include "cc/cudnn/op_kernel_resources.h"
#include "cc/cudnn/types.h"
#include "cc/fused_conv/cudnn_fused_convolution.h"
#include "cc/fused_conv/fused_conv_attrs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"

namespace tf_ucudnn {
namespace {

using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

template <typename T, int kNumSpatialDims>
class UcudnnFusedConvGpuOp : public tensorflow::OpKernel {
 public:
  explicit UcudnnFusedConvGpuOp(OpKernelConstruction* ctx) : tensorflow::OpKernel(ctx) {
    std::string activation;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &activation));
    OP_REQUIRES_OK(ctx, Describe(ParseActivation(activation, &activation_)));
    OP_REQUIRES_OK(ctx, Describe(ReadConvAttrs(ctx, kNumSpatialDims, &attrs_)));
    absl::Status status = ReadPlanAttrs(ctx, ConvKernel::kForward, OwnPlanAttrs(), &plan_);
    if (status.ok()) status = ReadPlanBatchSize(ctx, plan_, &plan_batch_size_);
    OP_REQUIRES_OK(ctx, Describe(status));
    // The plans the gradient hands the backprop ops fail here, where they were written.
    for (auto [kernel, names] :
         {std::make_pair(ConvKernel::kBackpropInput, BackpropInputPlanAttrs()),
          std::make_pair(ConvKernel::kBackpropFilter, BackpropFilterPlanAttrs())}) {
      MicroBatchPlan gradient_plan;
      status = ReadPlanAttrs(ctx, kernel, names, &gradient_plan);
      OP_REQUIRES_OK(ctx, Describe(status, absl::StrCat(" (gradient's ", KernelName(kernel),
                                                        " kernel)")));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& bias = ctx->input(2);
    ConvGeometry geometry;
    absl::Status status = ComputeConvGeometry(attrs_, Dims(ctx->input(0).shape()),
                                              Dims(ctx->input(1).shape()), &geometry);
    if (status.ok()) {
      status = CheckBias(bias.dims(), bias.dims() == 1 ? bias.dim_size(0) : -1,
                         geometry.out_channels, bias.shape().DebugString());
    }
    std::vector<MicroBatch> micro_batches;
    if (status.ok()) {
      status = PlanFor(plan_, plan_batch_size_, geometry.batch)
                   .Resolve(geometry.batch, &micro_batches);
    }
    OP_REQUIRES_OK(ctx, Describe(status, absl::StrCat(" (plan ", plan_.DebugString(), ")")));

    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, tensorflow::TensorShape(geometry.OutputShape(geometry.batch)),
                            &output));
    OpKernelResources resources(ctx);
    status = RunFusedConvolution(&resources, geometry, micro_batches, CudnnDataType<T>::value,
                                 activation_,
                                 {Mutable(ctx->input(0)), Mutable(ctx->input(1)), Mutable(bias),
                                  Mutable(*output)});
    OP_REQUIRES_OK(ctx, Describe(status, absl::StrCat(" (plan ", plan_.DebugString(), ")")));
  }

 private:
  // Errors name the op, the node, what `where` adds (the plan) and the reason.
  absl::Status Describe(const absl::Status& status, const std::string& where = "") const {
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat(type_string(), " '", name(), "'", where,
                                                    ": ", status.message()));
  }

  static void* Mutable(const Tensor& tensor) {
    return const_cast<T*>(tensor.flat<T>().data());
  }

  FusedActivation activation_ = FusedActivation::kRelu;
  ConvAttrs attrs_;
  MicroBatchPlan plan_;
  int64_t plan_batch_size_ = -1;
};

}  // namespace

#define REGISTER_GPU(T)                                                                     \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("UcudnnFusedConv2D").Device(tensorflow::DEVICE_GPU).TypeConstraint<T>("T"),      \
      (UcudnnFusedConvGpuOp<T, 2>));                                                        \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("UcudnnFusedConv3D").Device(tensorflow::DEVICE_GPU).TypeConstraint<T>("T"),      \
      (UcudnnFusedConvGpuOp<T, 3>));

REGISTER_GPU(Eigen::half);
REGISTER_GPU(tensorflow::bfloat16);
REGISTER_GPU(float);
REGISTER_GPU(double);

}  // namespace tf_ucudnn

#endif  // GOOGLE_CUDA
