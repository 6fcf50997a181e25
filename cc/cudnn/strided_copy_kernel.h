// A StridedCopy as its kernel runs it: dims ordered by the destination's strides, divisions by the
// dims as multiplications, and each side's bounds as the coordinates it checks. Host and device
// code that calls nothing in CUDA's runtime, so that a host program can run the same per-element
// code (tests/kernels/layout_copies_check.cc).
#ifndef TF_UCUDNN_CC_CUDNN_STRIDED_COPY_KERNEL_H_
#define TF_UCUDNN_CC_CUDNN_STRIDED_COPY_KERNEL_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <numeric>

#include "cc/cudnn/strided_copy.h"

#ifdef __CUDACC__
#define TF_UCUDNN_HOST_DEVICE __host__ __device__
#else
#define TF_UCUDNN_HOST_DEVICE
#endif

namespace tf_ucudnn {

// Division by a divisor known before the launch as a multiplication and a shift (Granlund and
// Montgomery; CUTLASS's FastDivmod): a GPU divides integers in tens of instructions, and the copy
// divides once per dim per element. Exact for dividends in [0, 2^31).
struct FastDivisor {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  FastDivisor() = default;
  explicit FastDivisor(uint32_t d) : divisor(d) {
    if (d <= 1) return;
    uint32_t ceil_log2 = 0;
    while ((uint64_t{1} << ceil_log2) < d) ++ceil_log2;
    const uint32_t p = 31 + ceil_log2;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << p) + d - 1) / d);
    shift = p - 32;
  }

  TF_UCUDNN_HOST_DEVICE uint32_t Quotient(uint32_t n) const {
    if (divisor == 1) return n;
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> 32) >> shift;
  }
};

// One side of a copy: where each index lies (offset and strides per copy dim) and the
// coordinates that decide whether its element exists, one per bounded axis: start plus the index
// times steps per copy dim, within [0, bound).
template <typename Index>
struct DeviceSide {
  Index offset = 0;
  Index strides[kMaxCopyRank] = {};
  int checks = 0;
  Index starts[kMaxCopyRank] = {};
  Index bounds[kMaxCopyRank] = {};
  Index steps[kMaxCopyRank][kMaxCopyRank] = {};

  TF_UCUDNN_HOST_DEVICE bool Holds(const Index* index) const {
    bool holds = true;
#ifdef __CUDACC__
#pragma unroll
#endif
    for (int k = 0; k < kMaxCopyRank; ++k) {
      if (k >= checks) break;
      Index at = starts[k];
#ifdef __CUDACC__
#pragma unroll
#endif
      for (int d = 0; d < kMaxCopyRank; ++d) at += index[d] * steps[k][d];
      holds = holds && at >= 0 && at < bounds[k];
    }
    return holds;
  }
};

template <typename Index>
struct DeviceCopy {
  int rank = 0;
  Index dims[kMaxCopyRank] = {};
  FastDivisor divisors[kMaxCopyRank];
  DeviceSide<Index> src;
  DeviceSide<Index> dst;
};

// The copy with its dims ordered by the destination's strides, largest first, so that
// neighbouring threads write neighbouring elements. Bounds stay by axis.
inline StridedCopy DestinationOrdered(const StridedCopy& copy) {
  int order[kMaxCopyRank];
  std::iota(order, order + copy.rank, 0);
  std::stable_sort(order, order + copy.rank, [&](int a, int b) {
    return std::abs(copy.dst.strides[a]) > std::abs(copy.dst.strides[b]);
  });
  StridedCopy ordered = copy;
  const auto reorder = [&](const CopySide& from, CopySide& to) {
    for (int d = 0; d < copy.rank; ++d) {
      to.strides[d] = from.strides[order[d]];
      to.axes[d] = from.axes[order[d]];
      to.steps[d] = from.steps[order[d]];
    }
  };
  for (int d = 0; d < copy.rank; ++d) ordered.dims[d] = copy.dims[order[d]];
  reorder(copy.src, ordered.src);
  reorder(copy.dst, ordered.dst);
  return ordered;
}

template <typename Index>
DeviceSide<Index> MakeDeviceSide(const StridedCopy& copy, const CopySide& side) {
  DeviceSide<Index> device;
  device.offset = static_cast<Index>(side.offset);
  for (int d = 0; d < copy.rank; ++d) device.strides[d] = static_cast<Index>(side.strides[d]);
  for (int axis = 0; axis < kMaxCopyRank; ++axis) {
    if (side.bounds[axis] <= 0) continue;
    const int k = device.checks++;
    device.starts[k] = static_cast<Index>(side.starts[axis]);
    device.bounds[k] = static_cast<Index>(side.bounds[axis]);
    for (int d = 0; d < copy.rank; ++d) {
      if (side.axes[d] == axis) device.steps[k][d] = static_cast<Index>(side.steps[d]);
    }
  }
  return device;
}

template <typename Index>
DeviceCopy<Index> MakeDeviceCopy(const StridedCopy& copy) {
  DeviceCopy<Index> device;
  device.rank = copy.rank;
  for (int d = 0; d < copy.rank; ++d) {
    device.dims[d] = static_cast<Index>(copy.dims[d]);
    if (sizeof(Index) == 4) device.divisors[d] = FastDivisor(static_cast<uint32_t>(copy.dims[d]));
  }
  device.src = MakeDeviceSide<Index>(copy, copy.src);
  device.dst = MakeDeviceSide<Index>(copy, copy.dst);
  return device;
}

// Copies the element at `linear`, the last copy dim varying fastest.
template <typename Word, typename Index>
TF_UCUDNN_HOST_DEVICE void CopyElement(const DeviceCopy<Index>& copy, Index linear,
                                       const Word* src, Word* dst) {
  Index rest = linear;
  Index src_offset = copy.src.offset;
  Index dst_offset = copy.dst.offset;
  Index index[kMaxCopyRank] = {};
#ifdef __CUDACC__
#pragma unroll
#endif
  for (int d = kMaxCopyRank - 1; d >= 0; --d) {
    if (d >= copy.rank) continue;
    Index quotient;
    if constexpr (sizeof(Index) == 4) {
      quotient = static_cast<Index>(copy.divisors[d].Quotient(static_cast<uint32_t>(rest)));
    } else {
      quotient = rest / copy.dims[d];
    }
    index[d] = rest - quotient * copy.dims[d];
    rest = quotient;
    src_offset += index[d] * copy.src.strides[d];
    dst_offset += index[d] * copy.dst.strides[d];
  }
  if (copy.dst.Holds(index)) dst[dst_offset] = copy.src.Holds(index) ? src[src_offset] : Word(0);
}

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_STRIDED_COPY_KERNEL_H_
