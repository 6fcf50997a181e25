// The micro-batch plan an op carries: ordered micro-batch sizes, each with an algorithm.
// Mirrors tf_ucudnn/core/plan.py; see there for the text format of an algorithm.
#ifndef TF_UCUDNN_CC_CONV_MICRO_BATCH_PLAN_H_
#define TF_UCUDNN_CC_CONV_MICRO_BATCH_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cc/conv/conv_geometry.h"

namespace tf_ucudnn {

// cudnnMathType_t values; kFromTensorFlow follows TensorFlow's precision settings.
enum class MathMode : int {
  kFromTensorFlow = -1,
  kDefault = 0,
  kTensorOp = 1,
  kTensorOpAllowConversion = 2,
  kFma = 3,
};

struct AlgorithmSpec {
  bool automatic = true;  // chosen by cuDNN's heuristics at run time
  int algo = -1;          // a cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t value
  MathMode math = MathMode::kFromTensorFlow;

  static absl::Status Parse(const std::string& text, ConvKernel kernel, AlgorithmSpec* spec);
  std::string ToString() const;
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

// Number of legacy cuDNN algorithms for a kernel (cuDNN 9's *_ALGO_COUNT).
int AlgorithmCount(ConvKernel kernel);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CONV_MICRO_BATCH_PLAN_H_
