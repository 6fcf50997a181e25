// Fused convolution ops: y = activation(convolution(x, filter) + bias) as one op, so that a
// layer's bias and activation run in the convolution's cuDNN call and no pre-activation tensor is
// ever stored (the gradient, in tf_ucudnn/kernels/fused_conv.py, needs only y).
//
//   UcudnnFusedConv2D   <- Conv2D + BiasAdd + Relu (or no activation), as TensorFlow's own
//   UcudnnFusedConv3D   <- Conv3D + BiasAdd + Relu    _FusedConv2D fuses them for inference
//
// The convolution's attributes and plans are those of UcudnnConv2D / UcudnnConv3D (cc/conv/), and
// so is the shape function: it is run first, then the bias is checked against its output.
#include "absl/strings/str_cat.h"
#include "cc/conv/conv_attrs.h"
#include "cc/fused_conv/fused_conv_attrs.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_ucudnn {
namespace {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

absl::Status FusedShape(InferenceContext* c, const char* convolution_op, int nd) {
  const tensorflow::OpRegistrationData* convolution = nullptr;
  TF_RETURN_IF_ERROR(tensorflow::OpRegistry::Global()->LookUp(convolution_op, &convolution));
  TF_RETURN_IF_ERROR(convolution->shape_inference_fn(c));

  ConvAttrs attrs;
  TF_RETURN_IF_ERROR(ReadConvAttrs(c, nd, &attrs));
  auto known = [c](DimensionHandle d) { return c->ValueKnown(d) ? c->Value(d) : int64_t{-1}; };
  const bool rank_known = c->RankKnown(c->input(2));
  const int rank = rank_known ? c->Rank(c->input(2)) : -1;
  DimensionHandle channels = c->Dim(c->output(0), attrs.ChannelDim());
  const int64_t bias_size = rank == 1 ? known(c->Dim(c->input(2), 0)) : -1;
  TF_RETURN_IF_ERROR(CheckBias(rank, bias_size, known(channels), c->DebugString(c->input(2))));
  if (rank == 1) {
    // The bias may tell the output's channels where the filter does not.
    TF_RETURN_IF_ERROR(c->Merge(channels, c->Dim(c->input(2), 0), &channels));
    ShapeHandle output;
    TF_RETURN_IF_ERROR(c->ReplaceDim(c->output(0), attrs.ChannelDim(), channels, &output));
    c->set_output(0, output);
  }
  return absl::OkStatus();
}

}  // namespace

#define UCUDNN_FUSED_CONV_ATTRS(formats, dilations)                   \
  .Attr("T: {half, bfloat16, float, double}")                         \
      .Attr("strides: list(int)")                                     \
      .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")                 \
      .Attr("explicit_paddings: list(int) = []")                      \
      .Attr("data_format: " formats)                                  \
      .Attr("dilations: list(int) = " dilations)                      \
      .Attr("activation: {'Identity', 'Relu'} = 'Relu'")              \
      .Attr("micro_batches: list(int) = []")                          \
      .Attr("algorithms: list(string) = []")                          \
      .Attr("plan_batch_size: int = -1")                              \
      .Attr("backprop_input_micro_batches: list(int) = []")           \
      .Attr("backprop_input_algorithms: list(string) = []")           \
      .Attr("backprop_filter_micro_batches: list(int) = []")          \
      .Attr("backprop_filter_algorithms: list(string) = []")

REGISTER_OP("UcudnnFusedConv2D")
    .Input("input: T")
    .Input("filter: T")
    .Input("bias: T")
    .Output("output: T")
    UCUDNN_FUSED_CONV_ATTRS("{'NHWC', 'NCHW'} = 'NHWC'", "[1, 1, 1, 1]")
    .SetShapeFn([](InferenceContext* c) { return FusedShape(c, "UcudnnConv2D", 2); })
    .Doc("activation(UcudnnConv2D(input, filter) + bias), each micro-batch one fused call.");

REGISTER_OP("UcudnnFusedConv3D")
    .Input("input: T")
    .Input("filter: T")
    .Input("bias: T")
    .Output("output: T")
    UCUDNN_FUSED_CONV_ATTRS("{'NDHWC', 'NCDHW'} = 'NDHWC'", "[1, 1, 1, 1, 1]")
    .SetShapeFn([](InferenceContext* c) { return FusedShape(c, "UcudnnConv3D", 3); })
    .Doc("activation(UcudnnConv3D(input, filter) + bias), each micro-batch one fused call.");

}  // namespace tf_ucudnn
