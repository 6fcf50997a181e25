// The XLA custom call a tf_ucudnn convolution compiles to on the GPU. When the op is compiled,
// its plan is resolved on the GPU (each micro-batch's algorithm and math made explicit) and the
// device memory its calls need is sized; XLA allocates that memory as the call's second result,
// so it counts in XLA's own buffer assignment. The call's attributes carry the rest:
//
//   kernel      ConvKernel as an integer
//   geometry    ConvGeometry::Encode()
//   sizes       micro-batch sizes, in order
//   algorithms  each micro-batch's algorithm as plan text, joined by ';': a legacy algorithm with
//               its math made explicit, or an engine configuration
//   cudnn_filter_layout  1 where the filter (or the filter gradient) is laid out as cuDNN's
//               filter is (`filter_minor_to_major`), so the call copies no filter; else 0
//   op_name     the op and node, for errors and logs
//
// Operands: forward (input, filter), backprop input (filter, out_backprop), backprop filter
// (input, out_backprop); results: (the kernel's result, scratch bytes).
#ifndef TF_UCUDNN_CC_CONV_CONV_CUSTOM_CALL_H_
#define TF_UCUDNN_CC_CONV_CONV_CUSTOM_CALL_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cc/common/conv_geometry.h"
#include "cc/common/micro_batch_plan.h"
#include "tensorflow/core/framework/types.pb.h"

namespace tf_ucudnn {

inline constexpr char kConvCustomCallTarget[] = "tf_ucudnn_convolution";

struct ConvCustomCall {
  ConvKernel kernel = ConvKernel::kForward;
  ConvGeometry geometry;
  std::vector<MicroBatch> micro_batches;  // engines, or legacy algorithms with explicit maths
  size_t scratch_bytes = 0;
  // The filter's layout for XLA as minor-to-major dims of TensorFlow's filter shape, where cuDNN's
  // filter is a permutation of it; empty: TensorFlow's own layout, copied by the call.
  std::vector<int64_t> filter_minor_to_major;
  std::string op_name;

  // The attributes above as the MLIR dictionary XLA hands a typed FFI handler.
  std::string BackendConfig() const;
};

// Resolves `micro_batches` (their algorithms may be "auto") for a convolution of `dtype` on the
// current GPU, lays its filter out as cuDNN's where it can, and sizes its scratch memory. Defined
// only where the cuDNN kernels are built.
absl::Status PlanConvCustomCall(tensorflow::DataType dtype, ConvKernel kernel,
                                const ConvGeometry& geometry,
                                const std::vector<MicroBatch>& micro_batches,
                                const std::string& op_name, ConvCustomCall* call);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CONV_CONV_CUSTOM_CALL_H_
