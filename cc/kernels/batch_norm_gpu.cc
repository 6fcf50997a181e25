// The batch normalization ops on the GPU: one cuDNN call each way on the channels-last tensor as
// it is (an NHWC or NDHWC descriptor), in cuDNN's persistent spatial mode where it takes the
// shape, else its plain spatial mode. cuDNN's legacy batch normalization calls are deprecated in
// cuDNN 9 but kept; they are the ones TensorFlow's FusedBatchNormV3 makes.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU
#include <vector>

#include "cc/kernels/batch_norm_op_kernel.h"
#include "cc/kernels/cudnn_support.h"

namespace tf_ucudnn {
namespace {

using GPUDevice = Eigen::GpuDevice;

// x's descriptor ([N, C, spatial...] stored channels-last) and the per-channel one.
struct BatchNormDescriptors {
  TensorDescriptor x;
  TensorDescriptor channels;

  absl::Status Init(const BatchNormShape& shape) {
    std::vector<int64_t> dims = {shape.dims.front(), shape.channels};
    dims.insert(dims.end(), shape.dims.begin() + 1, shape.dims.end() - 1);
    TF_RETURN_IF_ERROR(x.Init(CUDNN_DATA_FLOAT, /*channels_last=*/true, dims));
    std::vector<int64_t> per_channel(dims.size(), 1);
    per_channel[1] = shape.channels;
    return channels.Init(CUDNN_DATA_FLOAT, /*channels_last=*/false, per_channel);
  }
};

// Runs `call(mode)` in the persistent spatial mode, or in the plain one where cuDNN does not
// take the shape in the first.
template <typename Call>
absl::Status WithSpatialMode(Call call, const char* what) {
  cudnnStatus_t status = call(CUDNN_BATCHNORM_SPATIAL_PERSISTENT);
  if (status == CUDNN_STATUS_NOT_SUPPORTED) status = call(CUDNN_BATCHNORM_SPATIAL);
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(status, what);
  return absl::OkStatus();
}

// The scope a call holds: x's device current, and that stream's cuDNN handle.
struct CudnnCallScope {
  ScopedCudaDevice device;
  CudnnHandleLease handle;

  absl::Status Enter(tensorflow::OpKernelContext* ctx, const void* on_device) {
    int ordinal = 0;
    TF_RETURN_IF_ERROR(DeviceOfPointer(on_device, &ordinal));
    TF_RETURN_IF_ERROR(device.Enter(ordinal));
    return AcquireCudnnHandle(ordinal, ctx->eigen_gpu_device().stream(), &handle);
  }
};

}  // namespace

template <>
absl::Status BatchNormLauncher<GPUDevice>::Forward(
    tensorflow::OpKernelContext* ctx, const BatchNormShape& shape, float epsilon, const float* x,
    const float* scale, const float* offset, float* y, float* saved_mean, float* saved_inv_std) {
  CudnnCallScope scope;
  TF_RETURN_IF_ERROR(scope.Enter(ctx, x));
  BatchNormDescriptors descriptors;
  TF_RETURN_IF_ERROR(descriptors.Init(shape));
  const float one = 1.0f, zero = 0.0f;
  return WithSpatialMode(
      [&](cudnnBatchNormMode_t mode) {
        // No running averages: Keras keeps its own from the batch's statistics.
        return cudnnBatchNormalizationForwardTraining(
            scope.handle.get(), mode, &one, &zero, descriptors.x.get(), x, descriptors.x.get(),
            y, descriptors.channels.get(), scale, offset, 1.0, nullptr, nullptr, epsilon,
            saved_mean, saved_inv_std);
      },
      "cudnnBatchNormalizationForwardTraining");
}

template <>
absl::Status BatchNormLauncher<GPUDevice>::Backward(
    tensorflow::OpKernelContext* ctx, const BatchNormShape& shape, float epsilon,
    const float* dy, const float* x, const float* scale, const float* saved_mean,
    const float* saved_inv_std, float* dx, float* scale_backprop, float* offset_backprop) {
  CudnnCallScope scope;
  TF_RETURN_IF_ERROR(scope.Enter(ctx, x));
  BatchNormDescriptors descriptors;
  TF_RETURN_IF_ERROR(descriptors.Init(shape));
  const float one = 1.0f, zero = 0.0f;
  return WithSpatialMode(
      [&](cudnnBatchNormMode_t mode) {
        return cudnnBatchNormalizationBackward(
            scope.handle.get(), mode, &one, &zero, &one, &zero, descriptors.x.get(), x,
            descriptors.x.get(), dy, descriptors.x.get(), dx, descriptors.channels.get(), scale,
            scale_backprop, offset_backprop, epsilon, saved_mean, saved_inv_std);
      },
      "cudnnBatchNormalizationBackward");
}

REGISTER_KERNEL_BUILDER(Name("UcudnnBatchNorm").Device(tensorflow::DEVICE_GPU),
                        UcudnnBatchNormOp<GPUDevice>);
REGISTER_KERNEL_BUILDER(Name("UcudnnBatchNormGrad").Device(tensorflow::DEVICE_GPU),
                        UcudnnBatchNormGradOp<GPUDevice>);

}  // namespace tf_ucudnn

#endif  // GOOGLE_CUDA
