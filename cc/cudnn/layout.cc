// Strides of packed tensors in either layout, and the StridedCopy descriptions built from them.
#include "cc/cudnn/layout.h"

#include <algorithm>

namespace tf_ucudnn {
namespace {

std::vector<int64_t> LogicalDims(int64_t outer, int64_t channels,
                                 const std::vector<int64_t>& spatial) {
  std::vector<int64_t> dims = {outer, channels};
  dims.insert(dims.end(), spatial.begin(), spatial.end());
  return dims;
}

// Packed strides of `dims` (in its own storage order).
std::vector<int64_t> PackedStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (int d = static_cast<int>(dims.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * dims[d + 1];
  }
  return strides;
}

// Strides, per logical [N, C, spatial...] dim, of a packed tensor in channels-last or -first order.
std::vector<int64_t> LogicalStrides(const std::vector<int64_t>& logical, bool channels_last) {
  const int nd = static_cast<int>(logical.size()) - 2;
  std::vector<int64_t> storage = {logical[0]};
  if (!channels_last) storage.push_back(logical[1]);
  for (int i = 0; i < nd; ++i) storage.push_back(logical[2 + i]);
  if (channels_last) storage.push_back(logical[1]);
  const std::vector<int64_t> packed = PackedStrides(storage);
  std::vector<int64_t> strides(logical.size());
  strides[0] = packed[0];
  strides[1] = channels_last ? packed.back() : packed[1];
  for (int i = 0; i < nd; ++i) strides[2 + i] = packed[channels_last ? 1 + i : 2 + i];
  return strides;
}

// Strides, per logical [K, C / groups, spatial...] dim, of TensorFlow's filter layout
// [spatial..., C / groups, K].
std::vector<int64_t> TensorFlowFilterStrides(const ConvGeometry& g) {
  const int nd = g.num_spatial_dims();
  std::vector<int64_t> storage = g.filter_spatial;
  storage.push_back(g.GroupInChannels());
  storage.push_back(g.out_channels);
  const std::vector<int64_t> packed = PackedStrides(storage);
  std::vector<int64_t> strides = {packed[nd + 1], packed[nd]};
  for (int i = 0; i < nd; ++i) strides.push_back(packed[i]);
  return strides;
}

// A side of a copy whose dims are the tensor's own: strides per dim, the copy's index 0 at
// `start` (negative: before the tensor, read as zeros), bounded by `bounds` where given.
CopySide PlainSide(const std::vector<int64_t>& strides, const std::vector<int64_t>& start,
                   const std::vector<int64_t>& bounds) {
  CopySide side;
  for (size_t d = 0; d < strides.size(); ++d) {
    side.offset += start[d] * strides[d];
    side.strides[d] = strides[d];
    side.axes[d] = static_cast<int>(d);
    side.steps[d] = 1;
    side.starts[d] = start[d];
    side.bounds[d] = bounds.empty() ? 0 : bounds[d];
  }
  return side;
}

// A copy between two tensors of the same logical [outer, C, spatial...] dims.
StridedCopy MakeCopy(const std::vector<int64_t>& dims, const std::vector<int64_t>& dst_strides,
                     const std::vector<int64_t>& src_dims,
                     const std::vector<int64_t>& src_strides,
                     const std::vector<int64_t>& src_start) {
  StridedCopy copy;
  copy.rank = static_cast<int>(dims.size());
  for (int d = 0; d < copy.rank; ++d) copy.dims[d] = dims[d];
  copy.src = PlainSide(src_strides, src_start, src_dims);
  copy.dst = PlainSide(dst_strides, std::vector<int64_t>(dims.size(), 0), {});
  return copy;
}

// The copy dims of a tensor in space-to-depth blocks of `block`, [outer, C, dy, dx, row, column],
// on cuDNN's side: the [outer, C * block * block, rows, columns] tensor of `strides`.
CopySide BlockedSide(const std::vector<int64_t>& strides, int64_t block) {
  const std::vector<int64_t> per_dim = {strides[0], strides[1] * block * block,
                                        strides[1] * block, strides[1], strides[2], strides[3]};
  return PlainSide(per_dim, std::vector<int64_t>(per_dim.size(), 0), {});
}

// ... and on the other side: the [outer, C, rows, columns] tensor of `strides` and `dims`, its
// rows and columns `start` before the blocks' (its padding), the blocks' rows and columns past
// its own not there.
CopySide UnblockedSide(const std::vector<int64_t>& strides, const std::vector<int64_t>& dims,
                       const std::vector<int64_t>& start, int64_t block) {
  CopySide side;
  const std::vector<int64_t> per_dim = {strides[0], strides[1], strides[2],
                                        strides[3], strides[2] * block, strides[3] * block};
  const int axes[] = {0, 1, 2, 3, 2, 3};
  const int64_t steps[] = {1, 1, 1, 1, block, block};
  for (int d = 0; d < 6; ++d) {
    side.strides[d] = per_dim[d];
    side.axes[d] = axes[d];
    side.steps[d] = steps[d];
  }
  for (int a = 0; a < 4; ++a) {
    side.starts[a] = start[a];
    side.bounds[a] = a < 2 ? 0 : dims[a];
    side.offset += start[a] * strides[a];
  }
  return side;
}

}  // namespace

CudnnLayout::CudnnLayout(const ConvGeometry& g, bool float64, ConvForm form)
    : g_(g),
      channels_last_(g.channels_last && !float64 && form != ConvForm::kChannelsFirst),
      transposed_(channels_last_ != g.channels_last),
      form_(form),
      cudnn_in_channels_(g.GroupInChannels()),
      strides_(g.strides),
      filter_spatial_(g.filter_spatial) {
  const int nd = g.num_spatial_dims();
  symmetric_padding_.assign(nd, 0);
  extra_before_.assign(nd, 0);
  if (form_ == ConvForm::kSubsampled) {  // no padding (CheckForm): the samples are the output's
    padded_spatial_ = g.output_spatial;
    strides_.assign(nd, 1);
    needs_input_copy_ = true;
    covers_input_ = false;
    return;
  }
  if (form_ == ConvForm::kSpaceToDepth) {  // the copy pads; cuDNN's input is what the output reads
    block_ = g.strides[0];
    cudnn_in_channels_ *= block_ * block_;
    padded_spatial_.resize(nd);
    for (int i = 0; i < nd; ++i) {
      filter_spatial_[i] = (g.filter_spatial[i] + block_ - 1) / block_;
      padded_spatial_[i] = g.output_spatial[i] + filter_spatial_[i] - 1;
      extra_before_[i] = g.pad_before[i];
      covers_input_ =
          covers_input_ && padded_spatial_[i] * block_ - g.pad_before[i] >= g.input_spatial[i];
    }
    strides_.assign(nd, 1);
    needs_input_copy_ = true;
    return;
  }
  padded_spatial_ = g.input_spatial;
  for (int i = 0; i < nd; ++i) {
    symmetric_padding_[i] = std::min(g.pad_before[i], g.pad_after[i]);
    extra_before_[i] = g.pad_before[i] - symmetric_padding_[i];
    padded_spatial_[i] += extra_before_[i] + g.pad_after[i] - symmetric_padding_[i];
    needs_input_copy_ = needs_input_copy_ || padded_spatial_[i] != g.input_spatial[i];
  }
  needs_input_copy_ = needs_input_copy_ || transposed_;
}

std::vector<int64_t> CudnnLayout::FilterDims() const {
  return LogicalDims(g_.out_channels, cudnn_in_channels_, filter_spatial_);
}

std::vector<int64_t> CudnnLayout::InputDims(int64_t size) const {
  return LogicalDims(size, cudnn_in_channels_ * g_.groups, padded_spatial_);
}

std::vector<int64_t> CudnnLayout::OutputDims(int64_t size) const {
  return LogicalDims(size, g_.out_channels, g_.output_spatial);
}

int64_t CudnnLayout::PaddedInputSampleSize() const {
  int64_t elements = cudnn_in_channels_ * g_.groups;
  for (int64_t dim : padded_spatial_) elements *= dim;
  return elements;
}

int64_t CudnnLayout::FilterElements() const {
  int64_t elements = g_.out_channels * cudnn_in_channels_;
  for (int64_t dim : filter_spatial_) elements *= dim;
  return elements;
}

StridedCopy CudnnLayout::FilterToCudnn() const {
  if (form_ == ConvForm::kSpaceToDepth) return BlockedFilterCopy(/*to_cudnn=*/true);
  const auto dims = FilterDims();
  return MakeCopy(dims, LogicalStrides(dims, channels_last_), dims, TensorFlowFilterStrides(g_),
                  std::vector<int64_t>(dims.size(), 0));
}

StridedCopy CudnnLayout::FilterFromCudnn() const {
  if (form_ == ConvForm::kSpaceToDepth) return BlockedFilterCopy(/*to_cudnn=*/false);
  const auto dims = FilterDims();
  return MakeCopy(dims, TensorFlowFilterStrides(g_), dims, LogicalStrides(dims, channels_last_),
                  std::vector<int64_t>(dims.size(), 0));
}

std::vector<int64_t> CudnnLayout::FilterMinorToMajor() const {
  if (form_ == ConvForm::kSpaceToDepth) return {};
  // TensorFlow's dims: spatial 0..nd-1, C / groups at nd, K at nd + 1. cuDNN's filter is
  // [K, spatial..., C] channels-last and [K, C, spatial...] otherwise, K outermost in both.
  const int64_t nd = g_.num_spatial_dims();
  std::vector<int64_t> minor_to_major;
  if (channels_last_) minor_to_major.push_back(nd);
  for (int64_t d = nd - 1; d >= 0; --d) minor_to_major.push_back(d);
  if (!channels_last_) minor_to_major.push_back(nd);
  minor_to_major.push_back(nd + 1);
  return minor_to_major;
}

// `start` is where the destination's origin lies in the source.
StridedCopy CudnnLayout::InputCopy(int64_t size, bool to_cudnn) const {
  if (form_ == ConvForm::kSpaceToDepth) return BlockedInputCopy(size, to_cudnn);
  const auto input = LogicalDims(size, g_.in_channels, g_.input_spatial);
  const auto padded = InputDims(size);
  std::vector<int64_t> start(input.size(), 0);
  for (size_t i = 0; i < extra_before_.size(); ++i) {
    start[2 + i] = to_cudnn ? -extra_before_[i] : extra_before_[i];
  }
  auto input_strides = LogicalStrides(input, g_.channels_last);
  const auto padded_strides = LogicalStrides(padded, channels_last_);
  // Subsampled, the op's input is seen at its strided samples only, which cuDNN's copy holds.
  if (form_ == ConvForm::kSubsampled) {
    for (size_t i = 0; i < g_.strides.size(); ++i) input_strides[2 + i] *= g_.strides[i];
    return to_cudnn ? MakeCopy(padded, padded_strides, padded, input_strides, start)
                    : MakeCopy(padded, input_strides, padded, padded_strides, start);
  }
  return to_cudnn ? MakeCopy(padded, padded_strides, input, input_strides, start)
                  : MakeCopy(input, input_strides, padded, padded_strides, start);
}

StridedCopy CudnnLayout::OutputCopy(int64_t size, bool to_cudnn) const {
  const auto dims = OutputDims(size);
  const auto op_strides = LogicalStrides(dims, g_.channels_last);
  const auto cudnn_strides = LogicalStrides(dims, channels_last_);
  const std::vector<int64_t> start(dims.size(), 0);
  return to_cudnn ? MakeCopy(dims, cudnn_strides, dims, op_strides, start)
                  : MakeCopy(dims, op_strides, dims, cudnn_strides, start);
}

// Copy dims [K, C, dy, dx, row, column]: filter tap (row * s + dy, column * s + dx) of channel c
// is cuDNN's tap (row, column) of channel c * s * s + dy * s + dx; taps past the filter's are
// zeros in cuDNN's, and their gradients are not copied back.
StridedCopy CudnnLayout::BlockedFilterCopy(bool to_cudnn) const {
  const CopySide tensorflow =
      UnblockedSide(TensorFlowFilterStrides(g_),
                    {g_.out_channels, g_.in_channels, g_.filter_spatial[0], g_.filter_spatial[1]},
                    {0, 0, 0, 0}, block_);
  return BlockedCopy(g_.out_channels, LogicalStrides(FilterDims(), channels_last_), filter_spatial_,
                     tensorflow, to_cudnn);
}

// Copy dims [N, C, dy, dx, row, column]: input element (row * s + dy, column * s + dx) of the
// padded input is cuDNN's (row, column) of channel c * s * s + dy * s + dx; padding reads zero,
// and nothing is copied back to it.
StridedCopy CudnnLayout::BlockedInputCopy(int64_t size, bool to_cudnn) const {
  const auto input = LogicalDims(size, g_.in_channels, g_.input_spatial);
  const CopySide op = UnblockedSide(LogicalStrides(input, g_.channels_last), input,
                                    {0, 0, -g_.pad_before[0], -g_.pad_before[1]}, block_);
  return BlockedCopy(size, LogicalStrides(InputDims(size), channels_last_), padded_spatial_, op,
                     to_cudnn);
}

// Between `other` and cuDNN's tensor in blocks, of `cudnn_strides` and spatial dims `blocked`,
// over copy dims [outer, C, dy, dx, row, column].
StridedCopy CudnnLayout::BlockedCopy(int64_t outer, const std::vector<int64_t>& cudnn_strides,
                                     const std::vector<int64_t>& blocked, const CopySide& other,
                                     bool to_cudnn) const {
  StridedCopy copy;
  copy.rank = 6;
  const int64_t dims[] = {outer, g_.in_channels, block_, block_, blocked[0], blocked[1]};
  std::copy(dims, dims + 6, copy.dims);
  const CopySide cudnn = BlockedSide(cudnn_strides, block_);
  copy.src = to_cudnn ? other : cudnn;
  copy.dst = to_cudnn ? cudnn : other;
  return copy;
}

}  // namespace tf_ucudnn
