// Training batch normalization of a channels-last tensor, without the transposed copies
// TensorFlow's FusedBatchNormV3 makes of float32 NHWC on the GPU (it runs cuDNN in NCHW):
//
//   UcudnnBatchNorm      x [N, spatial..., C], scale [C], offset [C]
//                        -> y, saved_mean [C], saved_inv_std [C] (the batch's, biased variance)
//   UcudnnBatchNormGrad  dy, x, scale, saved_mean, saved_inv_std -> dx, scale_backprop,
//                        offset_backprop
//
// On the GPU each is one cuDNN call on the tensor as it is (an NHWC/NDHWC descriptor).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_ucudnn {
namespace {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// x of rank 4 or 5, channels last; the per-channel vectors at `vectors` match its channels.
absl::Status ChannelsLast(InferenceContext* c, int x, std::initializer_list<int> vectors,
                          DimensionHandle* channels) {
  ShapeHandle shape;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(x), 4, &shape));
  TF_RETURN_IF_ERROR(c->WithRankAtMost(shape, 5, &shape));
  *channels = c->Dim(shape, -1);
  for (int index : vectors) {
    ShapeHandle vector;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(index), 1, &vector));
    TF_RETURN_IF_ERROR(c->Merge(*channels, c->Dim(vector, 0), channels));
  }
  return absl::OkStatus();
}

REGISTER_OP("UcudnnBatchNorm")
    .Input("x: float")
    .Input("scale: float")
    .Input("offset: float")
    .Output("y: float")
    .Output("saved_mean: float")
    .Output("saved_inv_std: float")
    .Attr("epsilon: float = 0.001")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle channels;
      TF_RETURN_IF_ERROR(ChannelsLast(c, 0, {1, 2}, &channels));
      c->set_output(0, c->input(0));
      c->set_output(1, c->Vector(channels));
      c->set_output(2, c->Vector(channels));
      return absl::OkStatus();
    });

REGISTER_OP("UcudnnBatchNormGrad")
    .Input("dy: float")
    .Input("x: float")
    .Input("scale: float")
    .Input("saved_mean: float")
    .Input("saved_inv_std: float")
    .Output("dx: float")
    .Output("scale_backprop: float")
    .Output("offset_backprop: float")
    .Attr("epsilon: float = 0.001")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle channels;
      TF_RETURN_IF_ERROR(ChannelsLast(c, 1, {2, 3, 4}, &channels));
      ShapeHandle dx;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &dx));
      c->set_output(0, dx);
      c->set_output(1, c->Vector(channels));
      c->set_output(2, c->Vector(channels));
      return absl::OkStatus();
    });

}  // namespace
}  // namespace tf_ucudnn
