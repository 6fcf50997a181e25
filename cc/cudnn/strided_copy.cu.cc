// The strided copy kernel, by element width only: a copy moves bits, whatever the type.
#include "cc/cudnn/strided_copy.h"

#include <algorithm>
#include <cstdlib>

namespace tf_ucudnn {
namespace {

// Index is int32_t where every offset fits: a GPU divides 32-bit integers several times faster
// than 64-bit ones, and the copy does a division per dimension per element.
template <typename Word, typename Index>
__global__ void StridedCopyKernel(StridedCopy copy, Index total, const Word* src, Word* dst) {
  for (Index linear = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x; linear < total;
       linear += static_cast<Index>(gridDim.x) * blockDim.x) {
    Index rest = linear;
    Index dst_offset = 0;
    Index src_offset = 0;
    bool inside = true;
    for (int d = copy.rank - 1; d >= 0; --d) {
      const Index dim = static_cast<Index>(copy.dims[d]);
      const Index quotient = rest / dim;
      const Index index = rest - quotient * dim;
      rest = quotient;
      const Index source = index + static_cast<Index>(copy.src_start[d]);
      inside = inside && source >= 0 && source < copy.src_dims[d];
      dst_offset += index * static_cast<Index>(copy.dst_strides[d]);
      src_offset += source * static_cast<Index>(copy.src_strides[d]);
    }
    dst[dst_offset] = inside ? src[src_offset] : Word(0);
  }
}

// The largest offset plus one that the copy reaches in a tensor of `dims` and `strides`.
int64_t Extent(int rank, const int64_t* dims, const int64_t* strides) {
  int64_t extent = 1;
  for (int d = 0; d < rank; ++d) extent += (dims[d] - 1) * std::abs(strides[d]);
  return extent;
}

template <typename Word>
cudaError_t Launch(const StridedCopy& copy, const void* src, void* dst, cudaStream_t stream) {
  int64_t total = 1;
  for (int d = 0; d < copy.rank; ++d) total *= copy.dims[d];
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 8);
  // Headroom for the index past the last element that a grid-stride loop computes.
  const int64_t reach =
      std::max({total + blocks * kThreads, Extent(copy.rank, copy.dims, copy.dst_strides),
                Extent(copy.rank, copy.src_dims, copy.src_strides)});
  bool small_start = true;
  for (int d = 0; d < copy.rank; ++d) {
    small_start = small_start && std::abs(copy.src_start[d]) < (1 << 20);
  }
  if (reach < (int64_t{1} << 31) - (1 << 21) && small_start) {
    StridedCopyKernel<Word, int32_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        copy, static_cast<int32_t>(total), static_cast<const Word*>(src),
        static_cast<Word*>(dst));
  } else {
    StridedCopyKernel<Word, int64_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        copy, total, static_cast<const Word*>(src), static_cast<Word*>(dst));
  }
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
