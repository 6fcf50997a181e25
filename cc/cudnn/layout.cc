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

// A copy between two tensors of the same logical [outer, C, spatial...] dims.
StridedCopy MakeCopy(const std::vector<int64_t>& dims, const std::vector<int64_t>& dst_strides,
                     const std::vector<int64_t>& src_dims,
                     const std::vector<int64_t>& src_strides,
                     const std::vector<int64_t>& src_start) {
  StridedCopy copy;
  copy.rank = static_cast<int>(dims.size());
  for (int d = 0; d < copy.rank; ++d) {
    copy.dims[d] = dims[d];
    copy.dst_strides[d] = dst_strides[d];
    copy.src_dims[d] = src_dims[d];
    copy.src_strides[d] = src_strides[d];
    copy.src_start[d] = src_start[d];
  }
  return copy;
}

}  // namespace

CudnnLayout::CudnnLayout(const ConvGeometry& g, cudnnDataType_t type, bool subsampled)
    : g_(g),
      channels_last_(g.channels_last && type != CUDNN_DATA_DOUBLE),
      transposed_(channels_last_ != g.channels_last),
      subsampled_(subsampled),
      strides_(g.strides) {
  const int nd = g.num_spatial_dims();
  symmetric_padding_.assign(nd, 0);
  extra_before_.assign(nd, 0);
  if (subsampled_) {  // no padding (CheckSubsamplable): the strided samples are the output's positions
    padded_spatial_ = g.output_spatial;
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
  return LogicalDims(g_.out_channels, g_.GroupInChannels(), g_.filter_spatial);
}

std::vector<int64_t> CudnnLayout::InputDims(int64_t size) const {
  return LogicalDims(size, g_.in_channels, padded_spatial_);
}

std::vector<int64_t> CudnnLayout::OutputDims(int64_t size) const {
  return LogicalDims(size, g_.out_channels, g_.output_spatial);
}

int64_t CudnnLayout::PaddedInputSampleSize() const {
  int64_t elements = g_.in_channels;
  for (int64_t dim : padded_spatial_) elements *= dim;
  return elements;
}

StridedCopy CudnnLayout::FilterToCudnn() const {
  const auto dims = FilterDims();
  return MakeCopy(dims, LogicalStrides(dims, channels_last_), dims, TensorFlowFilterStrides(g_),
                  std::vector<int64_t>(dims.size(), 0));
}

StridedCopy CudnnLayout::FilterFromCudnn() const {
  const auto dims = FilterDims();
  return MakeCopy(dims, TensorFlowFilterStrides(g_), dims, LogicalStrides(dims, channels_last_),
                  std::vector<int64_t>(dims.size(), 0));
}

// `start` is where the destination's origin lies in the source.
StridedCopy CudnnLayout::InputCopy(int64_t size, bool to_cudnn) const {
  const auto input = LogicalDims(size, g_.in_channels, g_.input_spatial);
  const auto padded = InputDims(size);
  std::vector<int64_t> start(input.size(), 0);
  for (size_t i = 0; i < extra_before_.size(); ++i) {
    start[2 + i] = to_cudnn ? -extra_before_[i] : extra_before_[i];
  }
  auto input_strides = LogicalStrides(input, g_.channels_last);
  const auto padded_strides = LogicalStrides(padded, channels_last_);
  if (subsampled_) {  // the op's input seen at its strided samples only, which cuDNN's copy holds
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

}  // namespace tf_ucudnn
