// The strided copy kernel, by element width only: a copy moves bits, whatever the type.
#include "cc/cudnn/strided_copy.h"

#include <algorithm>
#include <cstdlib>

#include "cc/cudnn/strided_copy_kernel.h"

namespace tf_ucudnn {
namespace {

template <typename Word, typename Index>
__global__ void StridedCopyKernel(DeviceCopy<Index> copy, Index total, const Word* src,
                                  Word* dst) {
  for (Index linear = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x; linear < total;
       linear += static_cast<Index>(gridDim.x) * blockDim.x) {
    CopyElement(copy, linear, src, dst);
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

template <typename Word>
cudaError_t Launch(const StridedCopy& unordered, const void* src, void* dst,
                   cudaStream_t stream) {
  const StridedCopy copy = DestinationOrdered(unordered);
  int64_t total = 1;
  for (int d = 0; d < copy.rank; ++d) total *= copy.dims[d];
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 8);
  const auto grid = static_cast<unsigned>(blocks);
  const auto* from = static_cast<const Word*>(src);
  auto* to = static_cast<Word*>(dst);
  // Headroom for the index past the last element that a grid-stride loop computes.
  const int64_t reach =
      std::max({total + blocks * kThreads, Reach(copy, copy.src), Reach(copy, copy.dst)});
  if (reach < (int64_t{1} << 31) - (1 << 21)) {
    StridedCopyKernel<Word, int32_t><<<grid, kThreads, 0, stream>>>(
        MakeDeviceCopy<int32_t>(copy), static_cast<int32_t>(total), from, to);
  } else {
    StridedCopyKernel<Word, int64_t><<<grid, kThreads, 0, stream>>>(
        MakeDeviceCopy<int64_t>(copy), total, from, to);
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
