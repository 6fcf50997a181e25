// The batch normalization ops on the GPU: one cuDNN call each way on the channels-last tensor as
// it is (an NHWC or NDHWC descriptor), in cuDNN's persistent spatial mode where it takes the
// shape, else its plain spatial mode. cuDNN's legacy batch normalization calls are deprecated in
// cuDNN 9 but kept; they are the ones TensorFlow's FusedBatchNormV3 makes.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU
#include <vector>

#include "cc/batch_norm/batch_norm_op_kernel.h"
#include "cc/cudnn/cudnn_support.h"

namespace tf_ucudnn {
namespace {

using GPUDevice = Eigen::GpuDevice;

constexpr float kOne = 1.0f, kZero = 0.0f;

// What one cuDNN batch normalization call holds: x's device current, that stream's cuDNN handle,
// x's descriptor ([N, C, spatial...] stored channels-last) and the per-channel one.
class BatchNormCall {
 public:
  absl::Status Enter(tensorflow::OpKernelContext* ctx, const float* x,
                     const BatchNormShape& shape) {
    int ordinal = 0;
    TF_RETURN_IF_ERROR(DeviceOfPointer(x, &ordinal));
    TF_RETURN_IF_ERROR(device_.Enter(ordinal));
    TF_RETURN_IF_ERROR(AcquireCudnnHandle(ordinal, ctx->eigen_gpu_device().stream(), &handle_));
    std::vector<int64_t> dims = {shape.dims.front(), shape.channels};
    dims.insert(dims.end(), shape.dims.begin() + 1, shape.dims.end() - 1);
    TF_RETURN_IF_ERROR(x_.Init(CUDNN_DATA_FLOAT, /*channels_last=*/true, dims));
    std::vector<int64_t> per_channel(dims.size(), 1);
    per_channel[1] = shape.channels;
    return channels_.Init(CUDNN_DATA_FLOAT, /*channels_last=*/false, per_channel);
  }

  // Runs `call(handle, mode, x's descriptor, the per-channel one)` in the persistent spatial
  // mode, or in the plain one where cuDNN does not take the shape in the first.
  template <typename Call>
  absl::Status Run(Call call, const char* what) {
    cudnnStatus_t status =
        call(handle_.get(), CUDNN_BATCHNORM_SPATIAL_PERSISTENT, x_.get(), channels_.get());
    if (status == CUDNN_STATUS_NOT_SUPPORTED) {
      status = call(handle_.get(), CUDNN_BATCHNORM_SPATIAL, x_.get(), channels_.get());
    }
    TF_UCUDNN_RETURN_IF_CUDNN_ERROR(status, what);
    return absl::OkStatus();
  }

 private:
  ScopedCudaDevice device_;
  CudnnHandleLease handle_;
  TensorDescriptor x_;
  TensorDescriptor channels_;
};

}  // namespace

template <>
absl::Status BatchNormLauncher<GPUDevice>::Forward(
    tensorflow::OpKernelContext* ctx, const BatchNormShape& shape, float epsilon, const float* x,
    const float* scale, const float* offset, float* y, float* saved_mean, float* saved_inv_std) {
  BatchNormCall call;
  TF_RETURN_IF_ERROR(call.Enter(ctx, x, shape));
  return call.Run(
      [&](cudnnHandle_t handle, cudnnBatchNormMode_t mode, cudnnTensorDescriptor_t x_desc,
          cudnnTensorDescriptor_t channels_desc) {
        // No running averages: Keras keeps its own from the batch's statistics.
        return cudnnBatchNormalizationForwardTraining(
            handle, mode, &kOne, &kZero, x_desc, x, x_desc, y, channels_desc, scale, offset,
            1.0, nullptr, nullptr, epsilon, saved_mean, saved_inv_std);
      },
      "cudnnBatchNormalizationForwardTraining");
}

template <>
absl::Status BatchNormLauncher<GPUDevice>::Backward(
    tensorflow::OpKernelContext* ctx, const BatchNormShape& shape, float epsilon,
    const float* dy, const float* x, const float* scale, const float* saved_mean,
    const float* saved_inv_std, float* dx, float* scale_backprop, float* offset_backprop) {
  BatchNormCall call;
  TF_RETURN_IF_ERROR(call.Enter(ctx, x, shape));
  return call.Run(
      [&](cudnnHandle_t handle, cudnnBatchNormMode_t mode, cudnnTensorDescriptor_t x_desc,
          cudnnTensorDescriptor_t channels_desc) {
        return cudnnBatchNormalizationBackward(
            handle, mode, &kOne, &kZero, &kOne, &kZero, x_desc, x, x_desc, dy, x_desc, dx,
            channels_desc, scale, scale_backprop, offset_backprop, epsilon, saved_mean,
            saved_inv_std);
      },
      "cudnnBatchNormalizationBackward");
}

REGISTER_KERNEL_BUILDER(Name("UcudnnBatchNorm").Device(tensorflow::DEVICE_GPU),
                        UcudnnBatchNormOp<GPUDevice>);
REGISTER_KERNEL_BUILDER(Name("UcudnnBatchNormGrad").Device(tensorflow::DEVICE_GPU),
                        UcudnnBatchNormGradOp<GPUDevice>);

}  // namespace tf_ucudnn

#endif  // GOOGLE_CUDA
