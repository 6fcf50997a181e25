// μ-cuDNN's self-check: with TF_UCUDNN_SELF_CHECK=1, each planned kernel's first run is compared
// with one undivided run of a reference algorithm, by the normalized L2 error
// ||planned - reference|| / ||reference||; over the type's tolerance (or
// TF_UCUDNN_SELF_CHECK_TOLERANCE) the op fails naming the node, the kernel and the plan. It
// guards every micro-batch split and algorithm (or engine) a plan may pick.
#ifndef TF_UCUDNN_CC_CONV_SELF_CHECK_H_
#define TF_UCUDNN_CC_CONV_SELF_CHECK_H_

#include <cstdint>
#include <vector>

#include "cc/common/micro_batch_plan.h"
#include "tensorflow/core/framework/types.pb.h"

namespace tf_ucudnn {

struct SelfCheckSetting {
  bool enabled = false;
  double tolerance = 0;  // a result whose error is above it fails
};

// The environment's setting for data of `type`; tolerances default to what the reference's
// plain FP32 (FMA) arithmetic and the planned algorithms' (TF32, say) may differ by.
SelfCheckSetting SelfCheckFromEnvironment(tensorflow::DataType type);

// The reference run of a batch of `batch` samples: undivided, algorithm 0 (implicit GEMM), no
// tensor-op math.
MicroBatch ReferenceMicroBatch(int64_t batch);

// A value of half, bfloat16, float or double data as a double.
template <typename T>
double AsDouble(T value) {
  return static_cast<double>(static_cast<float>(value));
}
inline double AsDouble(double value) { return value; }

// ||result - reference|| / ||reference||; 0 where both are zero.
double NormalizedL2Error(const std::vector<double>& result, const std::vector<double>& reference);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CONV_SELF_CHECK_H_
