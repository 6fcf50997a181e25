// The batch normalization ops on the CPU: the reference the GPU kernels are tested against,
// sums in double.
#include <cmath>
#include <vector>

#include "cc/batch_norm/batch_norm_op_kernel.h"

namespace tf_ucudnn {

using CPUDevice = Eigen::ThreadPoolDevice;

template <>
absl::Status BatchNormLauncher<CPUDevice>::Forward(
    tensorflow::OpKernelContext*, const BatchNormShape& shape, float epsilon, const float* x,
    const float* scale, const float* offset, float* y, float* saved_mean, float* saved_inv_std) {
  const int64_t rows = shape.rows, channels = shape.channels;
  std::vector<double> sum(channels, 0.0), squares(channels, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < channels; ++c) sum[c] += x[r * channels + c];
  }
  for (int64_t c = 0; c < channels; ++c) saved_mean[c] = static_cast<float>(sum[c] / rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      const double centred = x[r * channels + c] - static_cast<double>(saved_mean[c]);
      squares[c] += centred * centred;
    }
  }
  for (int64_t c = 0; c < channels; ++c) {
    saved_inv_std[c] = static_cast<float>(1.0 / std::sqrt(squares[c] / rows + epsilon));
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t i = r * channels + c;
      y[i] = (x[i] - saved_mean[c]) * saved_inv_std[c] * scale[c] + offset[c];
    }
  }
  return absl::OkStatus();
}

template <>
absl::Status BatchNormLauncher<CPUDevice>::Backward(
    tensorflow::OpKernelContext*, const BatchNormShape& shape, float, const float* dy,
    const float* x, const float* scale, const float* saved_mean, const float* saved_inv_std,
    float* dx, float* scale_backprop, float* offset_backprop) {
  const int64_t rows = shape.rows, channels = shape.channels;
  std::vector<double> d_offset(channels, 0.0), d_scale(channels, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t i = r * channels + c;
      d_offset[c] += dy[i];
      d_scale[c] += dy[i] * (x[i] - saved_mean[c]) * static_cast<double>(saved_inv_std[c]);
    }
  }
  for (int64_t c = 0; c < channels; ++c) {
    offset_backprop[c] = static_cast<float>(d_offset[c]);
    scale_backprop[c] = static_cast<float>(d_scale[c]);
  }
  // dx = scale * inv_std / rows * (rows * dy - sum(dy) - x_hat * sum(dy * x_hat))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t i = r * channels + c;
      const double x_hat = (x[i] - saved_mean[c]) * static_cast<double>(saved_inv_std[c]);
      dx[i] = static_cast<float>(scale[c] * saved_inv_std[c] / rows *
                                 (rows * static_cast<double>(dy[i]) - d_offset[c] -
                                  x_hat * d_scale[c]));
    }
  }
  return absl::OkStatus();
}

REGISTER_KERNEL_BUILDER(Name("UcudnnBatchNorm").Device(tensorflow::DEVICE_CPU),
                        UcudnnBatchNormOp<CPUDevice>);
REGISTER_KERNEL_BUILDER(Name("UcudnnBatchNormGrad").Device(tensorflow::DEVICE_CPU),
                        UcudnnBatchNormGradOp<CPUDevice>);

}  // namespace tf_ucudnn
