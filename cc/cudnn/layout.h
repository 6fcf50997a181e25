// How cuDNN sees one convolution's tensors, where that differs from the op's, and the strided
// copies between the two: CudnnConvolution's descriptors and copies all come from here.
#ifndef TF_UCUDNN_CC_CUDNN_LAYOUT_H_
#define TF_UCUDNN_CC_CUDNN_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "cc/common/conv_geometry.h"
#include "cc/common/micro_batch_plan.h"
#include "cc/cudnn/strided_copy.h"

namespace tf_ucudnn {

// cuDNN pads symmetrically: it gets the smaller side of each dimension, and the rest is added to
// a copy of the micro-batch's input. cuDNN's legacy API has no float64 kernels for channels-last
// layouts (TensorFlow runs those channels-first too), so float64 NHWC/NDHWC micro-batches are
// transposed on their way in and out; in the channels-first form (ConvForm) any type's are, where
// cuDNN's channels-first kernels win by more than the copies cost. Dims are in cuDNN's logical
// order: [N, C, spatial...] for tensors, [K, C / groups, spatial...] for filters (the groups are
// the convolution descriptor's).
// No cuDNN header: the copies are checked without one (tests/kernels/test_layout_copies.py).
//
// The other forms (ConvForm, CheckForm) give cuDNN a stride-1 convolution in place of a strided
// one, whose strided kernels are slow within a small workspace. Subsampled, a 1x1 filter runs on
// a copy of the input's strided samples (cuDNN's stride-1 kernels for it are GEMMs); the input
// gradient's other samples are zero. In space-to-depth blocks of the stride s, the input's
// padded s x s blocks become channels (C * s * s of them, channel c * s * s + dy * s + dx holding
// row offset dy and column offset dx of channel c) and the filter's taps likewise, zero-filled
// to a multiple of s: a convolution over three input channels becomes one over twelve or more,
// which cuDNN's kernels run far better.
class CudnnLayout {
 public:
  // `g` must outlive the layout; `float64`: its elements are (cuDNN's CUDNN_DATA_DOUBLE); a `form`
  // other than kDirect needs CheckForm(g, form).
  CudnnLayout(const ConvGeometry& g, bool float64, ConvForm form = ConvForm::kDirect);

  bool channels_last() const { return channels_last_; }  // the layout cuDNN sees
  bool transposed() const { return transposed_; }        // ... differs from the op's
  bool needs_input_copy() const { return needs_input_copy_; }  // padded, transposed, or a form's
  ConvForm form() const { return form_; }
  const std::vector<int64_t>& symmetric_padding() const { return symmetric_padding_; }
  const std::vector<int64_t>& strides() const { return strides_; }  // cuDNN's
  // Whether copying cuDNN's input gradient back writes every element of the op's: not where the
  // form leaves out input the convolution does not read (those elements' gradient is zero).
  bool covers_input() const { return covers_input_; }

  std::vector<int64_t> FilterDims() const;
  std::vector<int64_t> InputDims(int64_t size) const;  // padded
  std::vector<int64_t> OutputDims(int64_t size) const;
  int64_t PaddedInputSampleSize() const;
  int64_t FilterElements() const;  // cuDNN's filter's

  // Between TensorFlow's filter layout [spatial..., C / groups, K] and cuDNN's.
  StridedCopy FilterToCudnn() const;
  StridedCopy FilterFromCudnn() const;
  // XLA's minor-to-major order for a filter of TensorFlow's dims [spatial..., C / groups, K]
  // stored as cuDNN's filter is, so that XLA, which lays out the operand, makes the copy; empty
  // where cuDNN's filter is not a permutation of TensorFlow's (space-to-depth blocks).
  std::vector<int64_t> FilterMinorToMajor() const;
  // Between a micro-batch of the op's input and cuDNN's copy of it (padded, subsampled or in
  // blocks, maybe transposed). From cuDNN's copy it writes the elements the copy holds only.
  StridedCopy InputCopy(int64_t size, bool to_cudnn) const;
  // Between a micro-batch of the op's output (or its gradient) and cuDNN's transposed copy.
  StridedCopy OutputCopy(int64_t size, bool to_cudnn) const;

 private:
  StridedCopy BlockedFilterCopy(bool to_cudnn) const;
  StridedCopy BlockedInputCopy(int64_t size, bool to_cudnn) const;
  StridedCopy BlockedCopy(int64_t outer, const std::vector<int64_t>& cudnn_strides,
                          const std::vector<int64_t>& blocked, const CopySide& other,
                          bool to_cudnn) const;

  const ConvGeometry& g_;
  bool channels_last_ = false;
  bool transposed_ = false;
  bool needs_input_copy_ = false;
  bool covers_input_ = true;
  ConvForm form_ = ConvForm::kDirect;
  int64_t block_ = 1;  // in space-to-depth blocks: the stride
  int64_t cudnn_in_channels_ = 0;  // per group
  std::vector<int64_t> symmetric_padding_;
  std::vector<int64_t> strides_;
  std::vector<int64_t> extra_before_;  // input padding cuDNN does not do, before each dimension
  std::vector<int64_t> padded_spatial_;  // cuDNN's input's spatial dims
  std::vector<int64_t> filter_spatial_;  // cuDNN's filter's
};

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_LAYOUT_H_
