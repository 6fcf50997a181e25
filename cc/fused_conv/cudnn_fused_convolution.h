// y = activation(convolution(x, w) + bias) on the GPU, as a plan's micro-batches: each one
// cudnnConvolutionBiasActivationForward call with the micro-batch's algorithm. The algorithms are
// resolved by the convolution executor (cc/cudnn/convolution.h), so a plan runs the same ones, with
// the same workspace, fused or not; descriptors, layouts and copies are cc/cudnn's too.
#ifndef TF_UCUDNN_CC_FUSED_CONV_CUDNN_FUSED_CONVOLUTION_H_
#define TF_UCUDNN_CC_FUSED_CONV_CUDNN_FUSED_CONVOLUTION_H_

#include <vector>

#include <cudnn.h>

#include "absl/status/status.h"
#include "cc/common/conv_geometry.h"
#include "cc/common/micro_batch_plan.h"
#include "cc/cudnn/conv_resources.h"
#include "cc/fused_conv/fused_conv_attrs.h"

namespace tf_ucudnn {

// The op's tensors, of one element type; the output is written.
struct FusedConvBuffers {
  void* input;
  void* filter;
  void* bias;  // out_channels values
  void* output;
};

// cuDNN's legacy fused call takes CUDNN_ACTIVATION_IDENTITY only with
// CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM: an Identity micro-batch with another algorithm
// runs cudnnConvolutionForward and then cudnnAddTensor, still within this op.
absl::Status RunFusedConvolution(ConvResources* resources, const ConvGeometry& geometry,
                                 const std::vector<MicroBatch>& micro_batches,
                                 cudnnDataType_t type, FusedActivation activation,
                                 FusedConvBuffers buffers);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_FUSED_CONV_CUDNN_FUSED_CONVOLUTION_H_
