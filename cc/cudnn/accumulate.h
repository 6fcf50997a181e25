// dst += src over `count` elements on a stream: how the filter gradients of a plan's later
// micro-batches join the first's when an engine configuration computed them (engines overwrite
// their output; they have no beta). One plain launch, no cuDNN descriptors. Compiled by nvcc; no
// TensorFlow headers.
#ifndef TF_UCUDNN_CC_CUDNN_ACCUMULATE_H_
#define TF_UCUDNN_CC_CUDNN_ACCUMULATE_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace tf_ucudnn {

enum class AccumulatedType { kHalf, kBfloat16, kFloat, kDouble };

// Half and bfloat16 add in float and round once, as cuDNN's beta = 1 does.
cudaError_t LaunchAccumulate(const void* src, void* dst, int64_t count, AccumulatedType type,
                             cudaStream_t stream);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_ACCUMULATE_H_
