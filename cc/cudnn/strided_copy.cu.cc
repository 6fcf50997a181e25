// The strided copy kernel, by element width only: a copy moves bits, whatever the type.
#include "cc/cudnn/strided_copy.h"

#include <algorithm>
#include <cstdlib>

namespace tf_ucudnn {
namespace {

// Whether the element at `coordinates` (per axis) exists on a side with these bounds.
template <typename Index>
__device__ bool Exists(const CopySide& side, const Index* coordinates) {
  bool exists = true;
#pragma unroll
  for (int a = 0; a < kMaxCopyRank; ++a) {
    exists = exists && (side.bounds[a] <= 0 ||
                        (coordinates[a] >= 0 && coordinates[a] < side.bounds[a]));
  }
  return exists;
}

// Index is int32_t where every offset fits: a GPU divides 32-bit integers several times faster
// than 64-bit ones, and the copy does a division per dimension per element. Blocked copies sum
// each axis's moves over every copy dim in registers (the loops unrolled, no indexing by a
// run-time axis), which costs more arithmetic per element: only they pay it.
template <typename Word, typename Index, bool kBlocked>
__global__ void StridedCopyKernel(StridedCopy copy, Index total, const Word* src, Word* dst) {
  for (Index linear = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x; linear < total;
       linear += static_cast<Index>(gridDim.x) * blockDim.x) {
    Index rest = linear;
    Index src_offset = static_cast<Index>(copy.src.offset);
    Index dst_offset = static_cast<Index>(copy.dst.offset);
    Index index[kMaxCopyRank] = {};
    bool read = true;
#pragma unroll
    for (int d = kMaxCopyRank - 1; d >= 0; --d) {
      if (d >= copy.rank) continue;
      const Index dim = static_cast<Index>(copy.dims[d]);
      const Index quotient = rest / dim;
      index[d] = rest - quotient * dim;
      rest = quotient;
      src_offset += index[d] * static_cast<Index>(copy.src.strides[d]);
      dst_offset += index[d] * static_cast<Index>(copy.dst.strides[d]);
      if (!kBlocked) {
        const Index source = index[d] + static_cast<Index>(copy.src.starts[d]);
        read = read && (copy.src.bounds[d] <= 0 || (source >= 0 && source < copy.src.bounds[d]));
      }
    }
    bool write = true;
    if (kBlocked) {
      Index src_at[kMaxCopyRank];
      Index dst_at[kMaxCopyRank];
#pragma unroll
      for (int a = 0; a < kMaxCopyRank; ++a) {
        src_at[a] = static_cast<Index>(copy.src.starts[a]);
        dst_at[a] = static_cast<Index>(copy.dst.starts[a]);
#pragma unroll
        for (int d = 0; d < kMaxCopyRank; ++d) {
          if (d >= copy.rank) continue;
          if (copy.src.axes[d] == a) src_at[a] += index[d] * static_cast<Index>(copy.src.steps[d]);
          if (copy.dst.axes[d] == a) dst_at[a] += index[d] * static_cast<Index>(copy.dst.steps[d]);
        }
      }
      read = Exists(copy.src, src_at);
      write = Exists(copy.dst, dst_at);
    }
    if (write) dst[dst_offset] = read ? src[src_offset] : Word(0);
  }
}

// The largest magnitude an offset or a coordinate of one side reaches, plus one.
int64_t Reach(const StridedCopy& copy, const CopySide& side) {
  int64_t offset = std::abs(side.offset) + 1;
  int64_t coordinate = 1;
  for (int d = 0; d < copy.rank; ++d) {
    offset += (copy.dims[d] - 1) * std::abs(side.strides[d]);
    coordinate += (copy.dims[d] - 1) * std::abs(side.steps[d]) + std::abs(side.starts[d]);
  }
  return std::max(offset, coordinate);
}

template <typename Word, typename Index>
void LaunchKernel(const StridedCopy& copy, int64_t blocks, int threads, int64_t total,
                  const void* src, void* dst, cudaStream_t stream) {
  const auto* from = static_cast<const Word*>(src);
  auto* to = static_cast<Word*>(dst);
  const auto grid = static_cast<unsigned>(blocks);
  if (copy.blocked) {
    StridedCopyKernel<Word, Index, true>
        <<<grid, threads, 0, stream>>>(copy, static_cast<Index>(total), from, to);
  } else {
    StridedCopyKernel<Word, Index, false>
        <<<grid, threads, 0, stream>>>(copy, static_cast<Index>(total), from, to);
  }
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
      std::max({total + blocks * kThreads, Reach(copy, copy.src), Reach(copy, copy.dst)});
  if (reach < (int64_t{1} << 31) - (1 << 21)) {
    LaunchKernel<Word, int32_t>(copy, blocks, kThreads, total, src, dst, stream);
  } else {
    LaunchKernel<Word, int64_t>(copy, blocks, kThreads, total, src, dst, stream);
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
