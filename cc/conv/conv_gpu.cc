// The GPU kernels of the six ops: each micro-batch is one cuDNN call (see cc/cudnn/convolution.h).
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <vector>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "cc/conv/conv_op_kernel.h"
#include "cc/cudnn/convolution.h"
#include "cc/cudnn/op_kernel_resources.h"
#include "cc/cudnn/types.h"

namespace tf_ucudnn {

using GPUDevice = Eigen::GpuDevice;

template <typename T>
struct ConvLauncher<GPUDevice, T> {
  static absl::Status Run(tensorflow::OpKernelContext* ctx, ConvKernel kernel,
                          const ConvGeometry& geometry,
                          const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> buffers) {
    OpKernelResources resources(ctx);
    return RunConvolution(&resources, kernel, geometry, micro_batches, CudnnDataType<T>::value,
                          {buffers.input, buffers.filter, buffers.output});
  }

  static absl::Status ToHost(tensorflow::OpKernelContext* ctx, const T* data, int64_t count,
                             std::vector<double>* host) {
    std::vector<T> copied(count);
    const cudaStream_t stream = ctx->eigen_gpu_device().stream();
    cudaError_t error = cudaMemcpyAsync(copied.data(), data, count * sizeof(T),
                                        cudaMemcpyDeviceToHost, stream);
    if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) {
      return absl::InternalError(absl::StrCat("copying a result to the host: ",
                                              cudaGetErrorString(error)));
    }
    host->resize(count);
    for (int64_t i = 0; i < count; ++i) (*host)[i] = AsDouble(copied[i]);
    return absl::OkStatus();
  }
};

#define REGISTER_GPU(T)                                                                      \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("UcudnnConv2D").Device(tensorflow::DEVICE_GPU).TypeConstraint<T>("T"),            \
      (UcudnnConvOp<GPUDevice, T, ConvKernel::kForward, 2>));                                \
  REGISTER_KERNEL_BUILDER(Name("UcudnnConv2DBackpropInput")                                  \
                              .Device(tensorflow::DEVICE_GPU)                                \
                              .TypeConstraint<T>("T")                                        \
                              .HostMemory("input_sizes"),                                    \
                          (UcudnnConvOp<GPUDevice, T, ConvKernel::kBackpropInput, 2>));      \
  REGISTER_KERNEL_BUILDER(Name("UcudnnConv2DBackpropFilter")                                 \
                              .Device(tensorflow::DEVICE_GPU)                                \
                              .TypeConstraint<T>("T")                                        \
                              .HostMemory("filter_sizes"),                                   \
                          (UcudnnConvOp<GPUDevice, T, ConvKernel::kBackpropFilter, 2>));     \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("UcudnnConv3D").Device(tensorflow::DEVICE_GPU).TypeConstraint<T>("T"),            \
      (UcudnnConvOp<GPUDevice, T, ConvKernel::kForward, 3>));                                \
  REGISTER_KERNEL_BUILDER(Name("UcudnnConv3DBackpropInput")                                  \
                              .Device(tensorflow::DEVICE_GPU)                                \
                              .TypeConstraint<T>("T")                                        \
                              .HostMemory("input_sizes"),                                    \
                          (UcudnnConvOp<GPUDevice, T, ConvKernel::kBackpropInput, 3>));      \
  REGISTER_KERNEL_BUILDER(Name("UcudnnConv3DBackpropFilter")                                 \
                              .Device(tensorflow::DEVICE_GPU)                                \
                              .TypeConstraint<T>("T")                                        \
                              .HostMemory("filter_sizes"),                                   \
                          (UcudnnConvOp<GPUDevice, T, ConvKernel::kBackpropFilter, 3>));

REGISTER_GPU(Eigen::half);
REGISTER_GPU(tensorflow::bfloat16);
REGISTER_GPU(float);
REGISTER_GPU(double);

}  // namespace tf_ucudnn

#endif  // GOOGLE_CUDA
