// The tables behind types.h, compiled once rather than in every kernel that names an algorithm.
#include "cc/cudnn/types.h"

#include "cc/common/micro_batch_plan.h"
#include "tsl/platform/tensor_float_32_utils.h"

namespace tf_ucudnn {

size_t ElementSize(cudnnDataType_t type) {
  switch (type) {
    case CUDNN_DATA_DOUBLE:
      return 8;
    case CUDNN_DATA_FLOAT:
      return 4;
    default:
      return 2;
  }
}

AccumulatedType AccumulatedTypeOf(cudnnDataType_t type) {
  switch (type) {
    case CUDNN_DATA_DOUBLE:
      return AccumulatedType::kDouble;
    case CUDNN_DATA_FLOAT:
      return AccumulatedType::kFloat;
    case CUDNN_DATA_BFLOAT16:
      return AccumulatedType::kBfloat16;
    default:
      return AccumulatedType::kHalf;
  }
}

cudnnDataType_t ComputeType(cudnnDataType_t type) {
  return type == CUDNN_DATA_DOUBLE ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
}

const void* ScaleFactor(cudnnDataType_t type, int value) {
  static constexpr float kFloat[] = {0, 1};
  static constexpr double kDouble[] = {0, 1};
  if (ComputeType(type) == CUDNN_DATA_DOUBLE) return &kDouble[value];
  return &kFloat[value];
}

const char* AlgorithmName(ConvKernel kernel, int algo) {
  static const char* const kForward[] = {"IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM",
                                         "DIRECT", "FFT", "FFT_TILING", "WINOGRAD",
                                         "WINOGRAD_NONFUSED"};
  static const char* const kBackpropInput[] = {"ALGO_0", "ALGO_1", "FFT", "FFT_TILING",
                                               "WINOGRAD", "WINOGRAD_NONFUSED"};
  static const char* const kBackpropFilter[] = {"ALGO_0",   "ALGO_1",
                                                "FFT",      "ALGO_3",
                                                "WINOGRAD", "WINOGRAD_NONFUSED",
                                                "FFT_TILING"};
  if (algo < 0 || algo >= AlgorithmCount(kernel)) return "?";
  switch (kernel) {
    case ConvKernel::kForward:
      return kForward[algo];
    case ConvKernel::kBackpropInput:
      return kBackpropInput[algo];
    case ConvKernel::kBackpropFilter:
      return kBackpropFilter[algo];
  }
  return "?";
}

bool IsDeterministic(ConvKernel kernel, int algo) {
  switch (kernel) {
    case ConvKernel::kForward:
      return true;
    case ConvKernel::kBackpropInput:
      return algo != CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;
    case ConvKernel::kBackpropFilter:
      return algo != CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 &&
             algo != CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
  }
  return false;
}

const char* MathName(cudnnMathType_t math) {
  switch (math) {
    case CUDNN_DEFAULT_MATH:
      return "default";
    case CUDNN_TENSOR_OP_MATH:
      return "tensor_op";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
      return "tensor_op_allow_conversion";
    case CUDNN_FMA_MATH:
      return "fma";
  }
  return "?";
}

cudnnMathType_t TensorFlowMath(cudnnDataType_t type) {
  switch (type) {
    case CUDNN_DATA_FLOAT:
      return tsl::tensor_float_32_execution_enabled() ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    case CUDNN_DATA_HALF:
    case CUDNN_DATA_BFLOAT16:
      return CUDNN_TENSOR_OP_MATH;
    default:
      return CUDNN_FMA_MATH;
  }
}

}  // namespace tf_ucudnn
