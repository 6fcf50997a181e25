// The profiling op: times every cuDNN algorithm of one convolution kernel at candidate
// micro-batch sizes. GPU only; tf_ucudnn.profiling.profiler drives it layer by layer.
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
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("kernel: {'fwd', 'bwd_data', 'bwd_filter'}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("data_format: {'NHWC', 'NCHW', 'NDHWC', 'NCDHW'}")
    .Attr("dilations: list(int)")
    .Attr("batch_sizes: list(int)")
    .Attr("workspace_limit: int")
    // Each run measures anew: never constant-folded, merged or skipped.
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Matrix(c->UnknownDim(), 6));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Times every algorithm cuDNN can run for one kernel of a convolution at each of `batch_sizes`
(cudnnFind*AlgorithmEx on the given tensors, using their first samples), with up to
`workspace_limit` bytes of workspace and the math TensorFlow would use for T.

measurements: one row per algorithm run: batch size, algorithm, cudnnMathType_t, time in
  milliseconds, workspace bytes, 1 if deterministic else 0.
)doc");

REGISTER_OP("UcudnnCudnnVersion")
    .Output("version: int64")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("cudnnGetVersion() of the cuDNN library tf_ucudnn's kernels run (GPU builds only).");

}  // namespace tf_ucudnn
