// What cuDNN's enums mean to tf_ucudnn: the cuDNN data type of each element type the kernels are
// registered for, the legacy algorithms' names and determinism, and the math TensorFlow would use.
#ifndef TF_UCUDNN_CC_CUDNN_TYPES_H_
#define TF_UCUDNN_CC_CUDNN_TYPES_H_

#include <cstddef>

#include <cudnn.h>

#include "cc/common/conv_geometry.h"
#include "cc/cudnn/accumulate.h"
#include "tensorflow/core/framework/numeric_types.h"

namespace tf_ucudnn {

template <typename T>
struct CudnnDataType;
template <>
struct CudnnDataType<Eigen::half> {
  static constexpr cudnnDataType_t value = CUDNN_DATA_HALF;
};
template <>
struct CudnnDataType<tensorflow::bfloat16> {
  static constexpr cudnnDataType_t value = CUDNN_DATA_BFLOAT16;
};
template <>
struct CudnnDataType<float> {
  static constexpr cudnnDataType_t value = CUDNN_DATA_FLOAT;
};
template <>
struct CudnnDataType<double> {
  static constexpr cudnnDataType_t value = CUDNN_DATA_DOUBLE;
};

// Bytes per element of half, bfloat16, float or double data.
size_t ElementSize(cudnnDataType_t type);

// The accumulation kernel's name for half, bfloat16, float or double data.
AccumulatedType AccumulatedTypeOf(cudnnDataType_t type);

// Half types accumulate in float; double stays double. alpha and beta scale in this type too.
cudnnDataType_t ComputeType(cudnnDataType_t type);

// 0 or 1 (`value`) as cuDNN reads alpha and beta for `type`'s data: in its compute type.
const void* ScaleFactor(cudnnDataType_t type, int value);

const char* AlgorithmName(ConvKernel kernel, int algo);

// cuDNN's documentation lists the backward ALGO_0s and the filter's ALGO_3 as non-deterministic
// (atomics across thread blocks); every forward algorithm is deterministic.
bool IsDeterministic(ConvKernel kernel, int algo);

const char* MathName(cudnnMathType_t math);

// The math TensorFlow's own Conv2D would use: float32 follows the TF32 setting
// (tf.config.experimental.enable_tensor_float_32_execution), half types use tensor cores,
// double stays on FMA units.
cudnnMathType_t TensorFlowMath(cudnnDataType_t type);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_TYPES_H_
