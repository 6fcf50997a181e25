// The two batch normalization ops' kernels, shared by the devices: checks, outputs, and the
// device's launcher (batch_norm_cpu.cc, batch_norm_gpu.cc) for the arithmetic.
#ifndef TF_UCUDNN_CC_BATCH_NORM_BATCH_NORM_OP_KERNEL_H_
#define TF_UCUDNN_CC_BATCH_NORM_BATCH_NORM_OP_KERNEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_ucudnn {

// x [N, spatial..., C] as rows of C values; `dims` is [N, spatial..., C].
struct BatchNormShape {
  std::vector<int64_t> dims;
  int64_t rows = 0;
  int64_t channels = 0;
};

template <typename Device>
struct BatchNormLauncher {
  static absl::Status Forward(tensorflow::OpKernelContext* ctx, const BatchNormShape& shape,
                              float epsilon, const float* x, const float* scale,
                              const float* offset, float* y, float* saved_mean,
                              float* saved_inv_std);
  static absl::Status Backward(tensorflow::OpKernelContext* ctx, const BatchNormShape& shape,
                               float epsilon, const float* dy, const float* x,
                               const float* scale, const float* saved_mean,
                               const float* saved_inv_std, float* dx, float* scale_backprop,
                               float* offset_backprop);
};

inline absl::Status ReadBatchNormShape(const tensorflow::Tensor& x,
                                       std::initializer_list<const tensorflow::Tensor*> vectors,
                                       BatchNormShape* shape) {
  if (x.dims() != 4 && x.dims() != 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x must be 4-D or 5-D, channels last, got shape ", x.shape().DebugString()));
  }
  const auto sizes = x.shape().dim_sizes();
  shape->dims.assign(sizes.begin(), sizes.end());
  shape->channels = shape->dims.back();
  shape->rows = shape->channels == 0 ? 0 : x.NumElements() / shape->channels;
  if (shape->rows == 0 || shape->channels == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch normalization needs values to normalize, got shape ", x.shape().DebugString()));
  }
  for (const tensorflow::Tensor* vector : vectors) {
    if (vector->dims() != 1 || vector->dim_size(0) != shape->channels) {
      return absl::InvalidArgumentError(absl::StrCat(
          "per-channel inputs must have shape [", shape->channels, "], got ",
          vector->shape().DebugString()));
    }
  }
  return absl::OkStatus();
}

// What the two ops share: the epsilon attribute, and outputs shaped like x then two
// per-channel vectors.
class BatchNormOpBase : public tensorflow::OpKernel {
 public:
  explicit BatchNormOpBase(tensorflow::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
  }

 protected:
  static absl::Status AllocateOutputs(tensorflow::OpKernelContext* ctx,
                                      const tensorflow::TensorShape& x,
                                      const BatchNormShape& shape, float* outputs[3]) {
    const tensorflow::TensorShape vector({shape.channels});
    for (int i = 0; i < 3; ++i) {
      tensorflow::Tensor* output = nullptr;
      TF_RETURN_IF_ERROR(ctx->allocate_output(i, i == 0 ? x : vector, &output));
      outputs[i] = output->flat<float>().data();
    }
    return absl::OkStatus();
  }

  float epsilon_ = 0;
};

template <typename Device>
class UcudnnBatchNormOp : public BatchNormOpBase {
 public:
  using BatchNormOpBase::BatchNormOpBase;

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& x = ctx->input(0);
    BatchNormShape shape;
    OP_REQUIRES_OK(ctx, ReadBatchNormShape(x, {&ctx->input(1), &ctx->input(2)}, &shape));
    float* y_mean_inv_std[3];
    OP_REQUIRES_OK(ctx, AllocateOutputs(ctx, x.shape(), shape, y_mean_inv_std));
    OP_REQUIRES_OK(ctx, BatchNormLauncher<Device>::Forward(
                            ctx, shape, epsilon_, x.flat<float>().data(),
                            ctx->input(1).flat<float>().data(),
                            ctx->input(2).flat<float>().data(), y_mean_inv_std[0],
                            y_mean_inv_std[1], y_mean_inv_std[2]));
  }
};

template <typename Device>
class UcudnnBatchNormGradOp : public BatchNormOpBase {
 public:
  using BatchNormOpBase::BatchNormOpBase;

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& dy = ctx->input(0);
    const tensorflow::Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "dy and x must have the same shape, got ", dy.shape().DebugString(),
                    " and ", x.shape().DebugString())));
    BatchNormShape shape;
    OP_REQUIRES_OK(ctx, ReadBatchNormShape(
                            x, {&ctx->input(2), &ctx->input(3), &ctx->input(4)}, &shape));
    float* dx_d_scale_d_offset[3];
    OP_REQUIRES_OK(ctx, AllocateOutputs(ctx, x.shape(), shape, dx_d_scale_d_offset));
    OP_REQUIRES_OK(ctx, BatchNormLauncher<Device>::Backward(
                            ctx, shape, epsilon_, dy.flat<float>().data(),
                            x.flat<float>().data(), ctx->input(2).flat<float>().data(),
                            ctx->input(3).flat<float>().data(),
                            ctx->input(4).flat<float>().data(), dx_d_scale_d_offset[0],
                            dx_d_scale_d_offset[1], dx_d_scale_d_offset[2]));
  }
};

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_BATCH_NORM_BATCH_NORM_OP_KERNEL_H_
