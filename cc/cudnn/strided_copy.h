// One GPU copy kernel for every layout change the cuDNN kernels need: permuting filters between
// TensorFlow's layout and cuDNN's, padding a micro-batch's input for asymmetric padding (cuDNN
// pads symmetrically only) and cropping a padded gradient back. Compiled by nvcc; no TensorFlow
// headers, so it builds with any CUDA toolkit.
#ifndef TF_UCUDNN_CC_CUDNN_STRIDED_COPY_H_
#define TF_UCUDNN_CC_CUDNN_STRIDED_COPY_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace tf_ucudnn {

constexpr int kMaxCopyRank = 6;

// dst[i] = src[i + src_start] where inside src's bounds, else zero; i ranges over `dims`.
// Strides are in elements; src_start may be negative (zero fill before) or positive (crop).
struct StridedCopy {
  int rank = 0;
  int64_t dims[kMaxCopyRank] = {};
  int64_t dst_strides[kMaxCopyRank] = {};
  int64_t src_dims[kMaxCopyRank] = {};
  int64_t src_strides[kMaxCopyRank] = {};
  int64_t src_start[kMaxCopyRank] = {};
};

// element_size is 2, 4 or 8 bytes; returns cudaErrorInvalidValue for anything else.
cudaError_t LaunchStridedCopy(const StridedCopy& copy, const void* src, void* dst,
                              int element_size, cudaStream_t stream);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_STRIDED_COPY_H_
