// Micro-batched convolution ops. Each mirrors a TensorFlow op (inputs, outputs, attributes and
// shape function) and adds the plan that splits its mini-batch. A plan is made for one batch size;
// another is an error, unless plan_batch_size names the plan's: then other batches (the last,
// partial one of an epoch) run undivided, the algorithm chosen at run time or by XLA.
//
//   UcudnnConv2D                  <- Conv2D
//   UcudnnConv2DBackpropInput     <- Conv2DBackpropInput
//   UcudnnConv2DBackpropFilter    <- Conv2DBackpropFilter
//   UcudnnConv3D                  <- Conv3D                 (+ EXPLICIT padding)
//   UcudnnConv3DBackpropInput     <- Conv3DBackpropInputV2  (+ EXPLICIT padding)
//   UcudnnConv3DBackpropFilter    <- Conv3DBackpropFilterV2 (+ EXPLICIT padding)
//
// Grouped convolutions are as TensorFlow's: a filter of input depth C / G groups an input of depth
// C into G groups. A depthwise convolution is one with G = C.
#include "absl/strings/str_cat.h"
#include "cc/conv/conv_attrs.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_ucudnn {
namespace {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// A plan whose sizes cannot add up to a batch size known while building the graph is an error
// right there, not when the step runs.
absl::Status CheckPlanBatch(InferenceContext* c, ConvKernel kernel, PlanAttrNames names,
                            DimensionHandle batch) {
  int64_t plan_batch_size = -1;
  TF_RETURN_IF_ERROR(c->GetAttr("plan_batch_size", &plan_batch_size));
  if (plan_batch_size >= 0) return absl::OkStatus();  // other batches run undivided
  MicroBatchPlan plan;
  TF_RETURN_IF_ERROR(ReadPlanAttrs(c, kernel, names, &plan));
  if (!plan.empty() && c->ValueKnown(batch) && plan.total() != c->Value(batch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan ", names.micro_batches, "/", names.algorithms, " ",
                     plan.DebugString(), " of the ", KernelName(kernel),
                     " kernel: the micro-batch sizes sum to ", plan.total(),
                     " but the batch has ", c->Value(batch), " samples"));
  }
  return absl::OkStatus();
}

// As TensorFlow's Conv2D shape function: the filter's input depth divides the input's, giving the
// groups, which divide the output depth.
absl::Status CheckGroups(InferenceContext* c, DimensionHandle in_depth, ShapeHandle filter,
                         int nd) {
  DimensionHandle filter_in_depth = c->Dim(filter, nd);
  DimensionHandle out_depth = c->Dim(filter, nd + 1);
  if (!c->ValueKnown(in_depth) || !c->ValueKnown(filter_in_depth) ||
      !c->ValueKnown(out_depth)) {
    return absl::OkStatus();
  }
  int64_t groups = 1;
  return ComputeGroups(c->Value(in_depth), c->Value(filter_in_depth), c->Value(out_depth),
                       &groups);
}

absl::Status ForwardShape(InferenceContext* c, int nd) {
  ConvAttrs attrs;
  TF_RETURN_IF_ERROR(ReadConvAttrs(c, nd, &attrs));
  ShapeHandle input, filter;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), nd + 2, &input));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), nd + 2, &filter));
  TF_RETURN_IF_ERROR(CheckGroups(c, c->Dim(input, attrs.ChannelDim()), filter, nd));

  DimensionHandle batch = c->Dim(input, attrs.BatchDim());
  std::vector<DimensionHandle> spatial;
  for (int i = 0; i < nd; ++i) {
    DimensionHandle in = c->Dim(input, attrs.SpatialDim(i));
    DimensionHandle k = c->Dim(filter, i);
    if (!c->ValueKnown(in) || !c->ValueKnown(k)) {
      spatial.push_back(c->UnknownDim());
      continue;
    }
    WindowedSize size;
    TF_RETURN_IF_ERROR(ComputeWindowedSize(c->Value(in), c->Value(k), attrs.strides[i],
                                           attrs.dilations[i], attrs.padding,
                                           attrs.explicit_before[i], attrs.explicit_after[i],
                                           &size));
    spatial.push_back(c->MakeDim(size.output));
  }
  std::vector<DimensionHandle> dims = {batch};
  if (!attrs.channels_last) dims.push_back(c->Dim(filter, nd + 1));
  dims.insert(dims.end(), spatial.begin(), spatial.end());
  if (attrs.channels_last) dims.push_back(c->Dim(filter, nd + 1));
  c->set_output(0, c->MakeShape(dims));

  TF_RETURN_IF_ERROR(CheckPlanBatch(c, ConvKernel::kForward, OwnPlanAttrs(), batch));
  TF_RETURN_IF_ERROR(
      CheckPlanBatch(c, ConvKernel::kBackpropInput, BackpropInputPlanAttrs(), batch));
  return CheckPlanBatch(c, ConvKernel::kBackpropFilter, BackpropFilterPlanAttrs(), batch);
}

// Backprop ops: the result's shape is given by a shape tensor (input 0 or 1).
absl::Status BackpropShape(InferenceContext* c, int nd, ConvKernel kernel) {
  ConvAttrs attrs;
  TF_RETURN_IF_ERROR(ReadConvAttrs(c, nd, &attrs));
  const int sizes_input = kernel == ConvKernel::kBackpropInput ? 0 : 1;
  ShapeHandle result, out_backprop;
  TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(sizes_input, &result));
  TF_RETURN_IF_ERROR(c->WithRank(result, nd + 2, &result));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), nd + 2, &out_backprop));
  c->set_output(0, result);
  // The input's depth: of the result (input gradient) or of the input (filter gradient); the
  // filter's shape: an input or the result.
  ShapeHandle filter = result;
  if (kernel == ConvKernel::kBackpropInput) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(1), nd + 2, &filter));
  }
  ShapeHandle input = result;
  if (kernel == ConvKernel::kBackpropFilter) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(0), nd + 2, &input));
  }
  TF_RETURN_IF_ERROR(CheckGroups(c, c->Dim(input, attrs.ChannelDim()), filter, nd));
  DimensionHandle batch = c->Dim(out_backprop, attrs.BatchDim());
  if (kernel == ConvKernel::kBackpropInput) {
    TF_RETURN_IF_ERROR(c->Merge(batch, c->Dim(result, attrs.BatchDim()), &batch));
  } else {
    // The input holds the batch too: a plan that cannot fit it is an error while out_backprop's
    // batch is still unknown.
    TF_RETURN_IF_ERROR(c->Merge(batch, c->Dim(input, attrs.BatchDim()), &batch));
  }
  return CheckPlanBatch(c, kernel, OwnPlanAttrs(), batch);
}

}  // namespace

#define UCUDNN_CONV_ATTRS(types, padding, formats, dilations) \
  .Attr("T: {" types "}")                                     \
      .Attr("strides: list(int)")                             \
      .Attr("use_cudnn_on_gpu: bool = true")                  \
      .Attr("padding: {" padding "}")                         \
      .Attr("explicit_paddings: list(int) = []")              \
      .Attr("data_format: " formats)                          \
      .Attr("dilations: list(int) = " dilations)              \
      .Attr("micro_batches: list(int) = []")                  \
      .Attr("algorithms: list(string) = []")                  \
      .Attr("plan_batch_size: int = -1")

#define UCUDNN_GRADIENT_PLAN_ATTRS                         \
  .Attr("backprop_input_micro_batches: list(int) = []")   \
      .Attr("backprop_input_algorithms: list(string) = []") \
      .Attr("backprop_filter_micro_batches: list(int) = []") \
      .Attr("backprop_filter_algorithms: list(string) = []")

#define UCUDNN_TYPES "half, bfloat16, float, double"
#define UCUDNN_PADDING "'SAME', 'VALID', 'EXPLICIT'"
#define UCUDNN_2D UCUDNN_CONV_ATTRS(UCUDNN_TYPES, UCUDNN_PADDING, "{'NHWC', 'NCHW'} = 'NHWC'", "[1, 1, 1, 1]")
#define UCUDNN_3D \
  UCUDNN_CONV_ATTRS(UCUDNN_TYPES, UCUDNN_PADDING, "{'NDHWC', 'NCDHW'} = 'NDHWC'", "[1, 1, 1, 1, 1]")

REGISTER_OP("UcudnnConv2D")
    .Input("input: T")
    .Input("filter: T")
    .Output("output: T")
    UCUDNN_2D UCUDNN_GRADIENT_PLAN_ATTRS
    .SetShapeFn([](InferenceContext* c) { return ForwardShape(c, 2); })
    .Doc("Conv2D run as the micro-batches of its plan, each with its own cuDNN algorithm.");

REGISTER_OP("UcudnnConv2DBackpropInput")
    .Input("input_sizes: int32")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("output: T")
    UCUDNN_2D
    .SetShapeFn([](InferenceContext* c) { return BackpropShape(c, 2, ConvKernel::kBackpropInput); })
    .Doc("Conv2DBackpropInput run as the micro-batches of its plan.");

REGISTER_OP("UcudnnConv2DBackpropFilter")
    .Input("input: T")
    .Input("filter_sizes: int32")
    .Input("out_backprop: T")
    .Output("output: T")
    UCUDNN_2D
    .SetShapeFn([](InferenceContext* c) { return BackpropShape(c, 2, ConvKernel::kBackpropFilter); })
    .Doc("Conv2DBackpropFilter run as the micro-batches of its plan, accumulating the gradient.");

REGISTER_OP("UcudnnConv3D")
    .Input("input: T")
    .Input("filter: T")
    .Output("output: T")
    UCUDNN_3D UCUDNN_GRADIENT_PLAN_ATTRS
    .SetShapeFn([](InferenceContext* c) { return ForwardShape(c, 3); })
    .Doc("Conv3D run as the micro-batches of its plan, each with its own cuDNN algorithm.");

REGISTER_OP("UcudnnConv3DBackpropInput")
    .Input("input_sizes: Tshape")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("output: T")
    UCUDNN_3D
    .Attr("Tshape: {int32, int64} = DT_INT32")
    .SetShapeFn([](InferenceContext* c) { return BackpropShape(c, 3, ConvKernel::kBackpropInput); })
    .Doc("Conv3DBackpropInputV2 run as the micro-batches of its plan.");

REGISTER_OP("UcudnnConv3DBackpropFilter")
    .Input("input: T")
    .Input("filter_sizes: int32")
    .Input("out_backprop: T")
    .Output("output: T")
    UCUDNN_3D
    .SetShapeFn([](InferenceContext* c) { return BackpropShape(c, 3, ConvKernel::kBackpropFilter); })
    .Doc("Conv3DBackpropFilterV2 run as the micro-batches of its plan, accumulating the gradient.");

}  // namespace tf_ucudnn
