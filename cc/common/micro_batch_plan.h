// The micro-batch plan an op carries: ordered micro-batch sizes, each with an algorithm.
// Mirrors tf_ucudnn/core/plan.py; see there for the text format of an algorithm.
#ifndef TF_UCUDNN_CC_COMMON_MICRO_BATCH_PLAN_H_
#define TF_UCUDNN_CC_COMMON_MICRO_BATCH_PLAN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cc/common/conv_geometry.h"

namespace tf_ucudnn {

// cudnnMathType_t values; kFromTensorFlow follows TensorFlow's precision settings.
enum class MathMode : int {
  kFromTensorFlow = -1,
  kDefault = 0,
  kTensorOp = 1,
  kTensorOpAllowConversion = 2,
  kFma = 3,
};

// How cuDNN is given a convolution (cc/cudnn/layout.h): as it is; as a stride-1 convolution on a
// copy of its input's strided samples (a 1x1 filter); as a stride-1 convolution on a copy of its
// input in space-to-depth blocks of the stride (a strided filter over few channels); or, for a
// channels-last op, on channels-first copies of its tensors (where cuDNN's channels-first
// kernels are the faster, as for grouped and depthwise convolutions).
enum class ConvForm : int { kDirect = 0, kSubsampled = 1, kSpaceToDepth = 2, kChannelsFirst = 3 };

// The form's name, as a plan's algorithm text flags it (",subsampled=1", ",space_to_depth=1",
// ",channels_first=1").
const char* FormName(ConvForm form);
// The form named `name` (FormName's inverse); false for no form's name.
bool FormFromName(absl::string_view name, ConvForm* form);

// A knob of a graph-API engine configuration: its KnobType_t name (SPLIT_K_SLC, ...) and value.
using EngineKnob = std::pair<std::string, int64_t>;

struct AlgorithmSpec {
  bool automatic = true;  // chosen by cuDNN's heuristics at run time
  int algo = -1;          // a cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t value
  MathMode math = MathMode::kFromTensorFlow;
  // A graph-API engine configuration instead of a legacy algorithm: the engine's global index
  // (-1: none) and its knob choices, sorted by name. Names are checked by cuDNN when it runs.
  int64_t engine = -1;
  std::vector<EngineKnob> knobs;
  ConvForm form = ConvForm::kDirect;  // the convolution's form (CheckForm)

  bool is_engine() const { return engine >= 0; }

  static absl::Status Parse(const std::string& text, ConvKernel kernel, AlgorithmSpec* spec);
  std::string ToString() const;

 private:
  static absl::Status ParseEngine(
      const std::map<std::string, std::string>& fields,
      const std::function<absl::Status(absl::string_view)>& syntax_error, AlgorithmSpec* spec);
};

struct MicroBatch {
  int64_t offset = 0;  // first sample of this micro-batch
  int64_t size = 0;
  AlgorithmSpec algorithm;
};

class MicroBatchPlan {
 public:
  // Validates the attribute values; `kernel` decides which algorithm numbers are legal.
  static absl::Status FromAttrs(ConvKernel kernel, const std::vector<int64_t>& sizes,
                                const std::vector<std::string>& algorithms, MicroBatchPlan* plan);

  // The micro-batches for a mini-batch of `batch` samples: the plan's own, or, for an empty
  // plan, one micro-batch with the algorithm chosen at run time.
  absl::Status Resolve(int64_t batch, std::vector<MicroBatch>* micro_batches) const;

  bool empty() const { return sizes_.empty(); }
  int64_t total() const;
  std::string DebugString() const;

 private:
  std::vector<int64_t> sizes_;
  std::vector<AlgorithmSpec> algorithms_;
};

// Whether a convolution can run in `form`, else why not. Subsampled, it needs a filter of one tap
// in every spatial dimension, no padding, and a stride above one (the strided samples are then all
// the output reads). In space-to-depth blocks, two spatial dimensions, one stride above one in
// both, a filter of more than one tap, no dilation and no groups.
absl::Status CheckForm(const ConvGeometry& g, ConvForm form);

// The form `micro_batches` of a convolution of `g` run in. All of a plan's micro-batches share it
// (they share cuDNN's view of the tensors); a plan that mixes forms, or gives a convolution a form
// it cannot take, is an error.
absl::Status PlanForm(const ConvGeometry& g, const std::vector<MicroBatch>& micro_batches,
                      ConvForm* form);

// Number of legacy cuDNN algorithms for a kernel (cuDNN 9's *_ALGO_COUNT).
int AlgorithmCount(ConvKernel kernel);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_COMMON_MICRO_BATCH_PLAN_H_
