#include "cc/conv/self_check.h"

#include <cmath>
#include <cstdlib>
#include <string>

namespace tf_ucudnn {

SelfCheckSetting SelfCheckFromEnvironment(tensorflow::DataType type) {
  SelfCheckSetting setting;
  const char* enabled = std::getenv("TF_UCUDNN_SELF_CHECK");
  setting.enabled = enabled != nullptr && (std::string(enabled) == "1" ||
                                           std::string(enabled) == "true");
  switch (type) {
    case tensorflow::DT_DOUBLE:
      setting.tolerance = 1e-6;
      break;
    case tensorflow::DT_HALF:
      setting.tolerance = 2e-2;
      break;
    case tensorflow::DT_BFLOAT16:
      setting.tolerance = 5e-2;
      break;
    default:  // float: TF32 tensor cores against plain FP32 stay near 1e-3
      setting.tolerance = 1e-2;
  }
  if (const char* tolerance = std::getenv("TF_UCUDNN_SELF_CHECK_TOLERANCE")) {
    setting.tolerance = std::atof(tolerance);
  }
  return setting;
}

MicroBatch ReferenceMicroBatch(int64_t batch) {
  MicroBatch reference;
  reference.size = batch;
  reference.algorithm.automatic = false;
  reference.algorithm.algo = 0;
  reference.algorithm.math = MathMode::kFma;
  return reference;
}

double NormalizedL2Error(const std::vector<double>& result, const std::vector<double>& reference) {
  double difference = 0, norm = 0;
  for (size_t i = 0; i < result.size(); ++i) {
    difference += (result[i] - reference[i]) * (result[i] - reference[i]);
    norm += reference[i] * reference[i];
  }
  if (norm == 0) return difference == 0 ? 0 : INFINITY;
  return std::sqrt(difference / norm);
}

}  // namespace tf_ucudnn
