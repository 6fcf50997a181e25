// How cuDNN sees one convolution's tensors, where that differs from the op's, and the strided
// copies between the two: CudnnConvolution's descriptors and copies all come from here.
#ifndef TF_UCUDNN_CC_CUDNN_LAYOUT_H_
#define TF_UCUDNN_CC_CUDNN_LAYOUT_H_

#include <cstdint>
#include <vector>

#include <cudnn.h>

#include "cc/conv/conv_geometry.h"
#include "cc/cudnn/strided_copy.h"

namespace tf_ucudnn {

// cuDNN pads symmetrically: it gets the smaller side of each dimension, and the rest is added to
// a copy of the micro-batch's input. cuDNN's legacy API has no float64 kernels for channels-last
// layouts (TensorFlow runs those channels-first too), so float64 NHWC/NDHWC micro-batches are
// transposed on their way in and out. Dims are in cuDNN's logical order: [N, C, spatial...] for
// tensors, [K, C / groups, spatial...] for filters (the groups are the convolution descriptor's).
//
// A subsampled layout runs a strided convolution of a 1x1 filter without padding
// (CheckSubsamplable) as a stride-1 convolution on a copy of the input's strided samples: cuDNN's
// strided kernels for it are slow within a small workspace, its stride-1 ones are GEMMs. The input
// gradient's other samples are zero.
class CudnnLayout {
 public:
  // `g` must outlive the layout; `subsampled` needs CheckSubsamplable(g).
  CudnnLayout(const ConvGeometry& g, cudnnDataType_t type, bool subsampled = false);

  bool channels_last() const { return channels_last_; }  // the layout cuDNN sees
  bool transposed() const { return transposed_; }        // ... differs from the op's
  bool needs_input_copy() const { return needs_input_copy_; }  // padded, transposed, subsampled
  bool subsampled() const { return subsampled_; }
  const std::vector<int64_t>& symmetric_padding() const { return symmetric_padding_; }
  const std::vector<int64_t>& strides() const { return strides_; }  // cuDNN's

  std::vector<int64_t> FilterDims() const;
  std::vector<int64_t> InputDims(int64_t size) const;  // padded
  std::vector<int64_t> OutputDims(int64_t size) const;
  int64_t PaddedInputSampleSize() const;

  // Between TensorFlow's filter layout [spatial..., C / groups, K] and cuDNN's.
  StridedCopy FilterToCudnn() const;
  StridedCopy FilterFromCudnn() const;
  // Between a micro-batch of the op's input and cuDNN's copy of it (padded or subsampled, maybe
  // transposed). From a subsampled copy it writes the strided samples only.
  StridedCopy InputCopy(int64_t size, bool to_cudnn) const;
  // Between a micro-batch of the op's output (or its gradient) and cuDNN's transposed copy.
  StridedCopy OutputCopy(int64_t size, bool to_cudnn) const;

 private:
  const ConvGeometry& g_;
  bool channels_last_ = false;
  bool transposed_ = false;
  bool needs_input_copy_ = false;
  bool subsampled_ = false;
  std::vector<int64_t> symmetric_padding_;
  std::vector<int64_t> strides_;
  std::vector<int64_t> extra_before_;  // input padding cuDNN does not do, before each dimension
  std::vector<int64_t> padded_spatial_;
};

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_LAYOUT_H_
