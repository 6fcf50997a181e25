// One GPU copy kernel for every layout change the cuDNN kernels need: permuting filters between
// TensorFlow's layout and cuDNN's, padding a micro-batch's input for asymmetric padding (cuDNN
// pads symmetrically only) and cropping a padded gradient back, gathering strided samples and
// space-to-depth blocks and scattering them back. Compiled by nvcc; no TensorFlow headers, so it
// builds with any CUDA toolkit.
#ifndef TF_UCUDNN_CC_CUDNN_STRIDED_COPY_H_
#define TF_UCUDNN_CC_CUDNN_STRIDED_COPY_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace tf_ucudnn {

constexpr int kMaxCopyRank = 6;

// Where each index of a copy lies in one of its tensors: index i (one value per copy dim) is the
// element at offset + sum_d i[d] * strides[d] (strides in elements). Whether that element exists:
// each copy dim moves along one axis of the tensor (axes[d]) by steps[d] per index, the element's
// coordinate on axis a is starts[a] plus those moves, and it exists where 0 <= coordinate <
// bounds[a] on every axis with a bound (bounds[a] > 0). Several copy dims moving along one axis
// (a space-to-depth block's offset and the block's index) are checked together.
struct CopySide {
  int64_t offset = 0;
  int64_t strides[kMaxCopyRank] = {};
  int axes[kMaxCopyRank] = {};
  int64_t steps[kMaxCopyRank] = {};
  int64_t starts[kMaxCopyRank] = {};
  int64_t bounds[kMaxCopyRank] = {};
};

// For every index in `dims`: the destination element gets the source's, or zero where the source
// element does not exist; where the destination element does not exist nothing is written.
struct StridedCopy {
  int rank = 0;
  int64_t dims[kMaxCopyRank] = {};
  CopySide src;
  CopySide dst;
};

// element_size is 2, 4 or 8 bytes; returns cudaErrorInvalidValue for anything else.
cudaError_t LaunchStridedCopy(const StridedCopy& copy, const void* src, void* dst,
                              int element_size, cudaStream_t stream);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_STRIDED_COPY_H_
