// cuDNN plumbing for the GPU kernels: errors as absl::Status, RAII descriptors, and one reused
// cuDNN handle per (device, stream).
#ifndef TF_UCUDNN_CC_CUDNN_CUDNN_SUPPORT_H_
#define TF_UCUDNN_CC_CUDNN_CUDNN_SUPPORT_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tf_ucudnn {

// NOT_SUPPORTED and BAD_PARAM are the caller's to fix (InvalidArgument); ALLOC_FAILED is
// ResourceExhausted; anything else is Internal.
absl::Status FromCudnn(cudnnStatus_t status, absl::string_view what);
absl::Status FromCuda(cudaError_t error, absl::string_view what);

#define TF_UCUDNN_RETURN_IF_CUDNN_ERROR(expr, what)              \
  do {                                                           \
    const cudnnStatus_t cudnn_status_ = (expr);                  \
    if (cudnn_status_ != CUDNN_STATUS_SUCCESS) {                 \
      return ::tf_ucudnn::FromCudnn(cudnn_status_, (what));      \
    }                                                            \
  } while (0)

#define TF_UCUDNN_RETURN_IF_CUDA_ERROR(expr, what)               \
  do {                                                           \
    const cudaError_t cuda_error_ = (expr);                      \
    if (cuda_error_ != cudaSuccess) {                            \
      return ::tf_ucudnn::FromCuda(cuda_error_, (what));         \
    }                                                            \
  } while (0)

// Makes `device` current for the scope; TensorFlow's op threads may have another one current.
class ScopedCudaDevice {
 public:
  ScopedCudaDevice() = default;
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  ~ScopedCudaDevice();
  absl::Status Enter(int device);

 private:
  int previous_ = -1;
};

// GPU time of `work` (what it enqueues on `stream`): one warm-up run, then the median of
// `repeats` runs, each between two CUDA events. An error from `work` ends the timing with it.
absl::Status MedianGpuTime(cudaStream_t stream, int repeats,
                           const std::function<absl::Status()>& work, float* time_ms);

// The device that owns a device pointer.
absl::Status DeviceOfPointer(const void* pointer, int* device);

// A cuDNN handle bound to one stream, held exclusively: handles are not thread-safe and
// TensorFlow may run several ops on one stream from different threads.
class CudnnHandleLease {
 public:
  CudnnHandleLease() = default;
  cudnnHandle_t get() const { return handle_; }

 private:
  friend absl::Status AcquireCudnnHandle(int device, cudaStream_t stream,
                                         CudnnHandleLease* lease);
  std::unique_lock<std::mutex> lock_;
  cudnnHandle_t handle_ = nullptr;
};

// Created on first use for (device, stream) and reused for the life of the process, as
// TensorFlow does with its own handles. `device` must be current.
absl::Status AcquireCudnnHandle(int device, cudaStream_t stream, CudnnHandleLease* lease);

// Tensor of shape [N, C, spatial...] stored channels-last (NHWC, NDHWC) or channels-first.
class TensorDescriptor {
 public:
  TensorDescriptor() = default;
  TensorDescriptor(const TensorDescriptor&) = delete;
  TensorDescriptor& operator=(const TensorDescriptor&) = delete;
  ~TensorDescriptor();
  absl::Status Init(cudnnDataType_t type, bool channels_last, const std::vector<int64_t>& dims);
  cudnnTensorDescriptor_t get() const { return desc_; }

 private:
  cudnnTensorDescriptor_t desc_ = nullptr;
};

// Filter of shape [K, C, spatial...] stored KRSC (channels_last) or KCRS.
class FilterDescriptor {
 public:
  FilterDescriptor() = default;
  FilterDescriptor(const FilterDescriptor&) = delete;
  FilterDescriptor& operator=(const FilterDescriptor&) = delete;
  ~FilterDescriptor();
  absl::Status Init(cudnnDataType_t type, bool channels_last, const std::vector<int64_t>& dims);
  cudnnFilterDescriptor_t get() const { return desc_; }

 private:
  cudnnFilterDescriptor_t desc_ = nullptr;
};

class ConvolutionDescriptor {
 public:
  ConvolutionDescriptor() = default;
  ConvolutionDescriptor(const ConvolutionDescriptor&) = delete;
  ConvolutionDescriptor& operator=(const ConvolutionDescriptor&) = delete;
  ~ConvolutionDescriptor();
  // `groups` as in ConvGeometry (the filter descriptor has C / groups input channels).
  absl::Status Init(const std::vector<int64_t>& pads, const std::vector<int64_t>& strides,
                    const std::vector<int64_t>& dilations, cudnnDataType_t compute_type,
                    cudnnMathType_t math, int64_t groups = 1);
  absl::Status SetMath(cudnnMathType_t math);
  cudnnConvolutionDescriptor_t get() const { return desc_; }

 private:
  cudnnConvolutionDescriptor_t desc_ = nullptr;
};

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_CUDNN_SUPPORT_H_
