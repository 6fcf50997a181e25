// The strided copy kernel, by element width only: a copy moves bits, whatever the type.
#include "cc/cudnn/strided_copy.h"

#include <algorithm>

namespace tf_ucudnn {
namespace {

template <typename Word>
__global__ void StridedCopyKernel(StridedCopy copy, int64_t total, const Word* src, Word* dst) {
  for (int64_t linear = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       linear < total; linear += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = linear;
    int64_t dst_offset = 0;
    int64_t src_offset = 0;
    bool inside = true;
    for (int d = copy.rank - 1; d >= 0; --d) {
      const int64_t index = rest % copy.dims[d];
      rest /= copy.dims[d];
      const int64_t source = index + copy.src_start[d];
      inside = inside && source >= 0 && source < copy.src_dims[d];
      dst_offset += index * copy.dst_strides[d];
      src_offset += source * copy.src_strides[d];
    }
    dst[dst_offset] = inside ? src[src_offset] : Word(0);
  }
}

template <typename Word>
cudaError_t Launch(const StridedCopy& copy, const void* src, void* dst, cudaStream_t stream) {
  int64_t total = 1;
  for (int d = 0; d < copy.rank; ++d) total *= copy.dims[d];
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 8);
  StridedCopyKernel<Word><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      copy, total, static_cast<const Word*>(src), static_cast<Word*>(dst));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchStridedCopy(const StridedCopy& copy, const void* src, void* dst,
                              int element_size, cudaStream_t stream) {
  if (copy.rank < 1 || copy.rank > kMaxCopyRank) return cudaErrorInvalidValue;
  switch (element_size) {
    case 2:
      return Launch<uint16_t>(copy, src, dst, stream);
    case 4:
      return Launch<uint32_t>(copy, src, dst, stream);
    case 8:
      return Launch<uint64_t>(copy, src, dst, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tf_ucudnn
