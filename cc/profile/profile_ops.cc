// The profiling op: times every cuDNN algorithm or engine configuration of one convolution kernel
// at candidate micro-batch sizes. GPU only; tf_ucudnn.profiling.profiler drives it layer by layer.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_ucudnn {

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("UcudnnProfileConvolution")
    .Input("input: T")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("measurements: double")
    .Output("algorithms: string")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("kernel: {'fwd', 'bwd_data', 'bwd_filter'}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("data_format: {'NHWC', 'NCHW', 'NDHWC', 'NCDHW'}")
    .Attr("dilations: list(int)")
    .Attr("batch_sizes: list(int)")
    .Attr("workspace_limit: int")
    .Attr("candidates: {'legacy', 'engines'} = 'legacy'")
    .Attr("form: {'direct', 'subsampled', 'space_to_depth', 'channels_first'} = 'direct'")
    // Each run measures anew: never constant-folded, merged or skipped.
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      auto rows = c->UnknownDim();
      c->set_output(0, c->Matrix(rows, 4));
      c->set_output(1, c->Vector(rows));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Times every candidate cuDNN can run for one kernel of a convolution at each of `batch_sizes`, on
the given tensors (their first samples), with up to `workspace_limit` bytes of workspace:
`candidates` 'legacy' times the legacy algorithms (cudnnFind*AlgorithmEx, with the math TensorFlow
would use for T), 'engines' the graph-API engine configurations of cuDNN's heuristics and their
knob variants (a warm-up run, then the median of five runs between CUDA events each). `form`
times them as cuDNN is given the convolution: 'direct' as it is, 'subsampled' as a stride-1
convolution on a copy of the input's strided samples (a 1x1 filter, no padding, a stride above
1), 'space_to_depth' as a stride-1 convolution on a copy of the input in blocks of the stride
(two spatial dims, one stride above 1, a filter of more than one tap, no dilation or groups),
'channels_first' on channels-first copies of a channels-last convolution's tensors; in the
latter three each time with the copies' and each workspace with the copies'.

measurements: one row per candidate run: batch size, time in milliseconds, workspace bytes,
  1 if cuDNN says it is deterministic else 0.
algorithms: each row's candidate as plan text ("algo=N,math=NAME" or "engine=N[,knobs=...]",
  then ",subsampled=1", ",space_to_depth=1" or ",channels_first=1" in those forms).
)doc");

REGISTER_OP("UcudnnCudnnVersion")
    .Output("version: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("cudnnGetVersion() of the cuDNN library tf_ucudnn's kernels run (GPU builds only).");

REGISTER_OP("UcudnnEnginesAvailable")
    .Output("available: bool")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("Whether the cuDNN kernels were built with cudnn-frontend, so that they can list, time "
         "and run graph-API engine configurations (GPU builds only).");

}  // namespace tf_ucudnn
