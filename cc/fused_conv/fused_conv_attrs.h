// The fused op's own attribute (its activation) and its bias check, shared by the shape function,
// the CPU kernel and the cuDNN kernel so that all three accept and reject the same things with the
// same words. No TensorFlow headers: the cuDNN executor includes it too.
#ifndef TF_UCUDNN_CC_FUSED_CONV_FUSED_CONV_ATTRS_H_
#define TF_UCUDNN_CC_FUSED_CONV_FUSED_CONV_ATTRS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tf_ucudnn {

enum class FusedActivation { kIdentity, kRelu };

// The op's attribute values (its enum restricts them; the kernels parse them once).
inline absl::Status ParseActivation(const std::string& name, FusedActivation* activation) {
  if (name == "Identity") {
    *activation = FusedActivation::kIdentity;
  } else if (name == "Relu") {
    *activation = FusedActivation::kRelu;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("activation must be 'Identity' or 'Relu', got '", name, "'"));
  }
  return absl::OkStatus();
}

inline const char* ActivationName(FusedActivation activation) {
  return activation == FusedActivation::kRelu ? "Relu" : "Identity";
}

// The bias is one value per output channel. `bias_rank` and the sizes may be -1 where a shape
// function does not know them yet; `bias_shape` describes the bias in the message.
inline absl::Status CheckBias(int bias_rank, int64_t bias_size, int64_t out_channels,
                              const std::string& bias_shape) {
  if (bias_rank >= 0 && bias_rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bias must be a vector of one value per output channel, got shape ", bias_shape));
  }
  if (bias_size >= 0 && out_channels >= 0 && bias_size != out_channels) {
    return absl::InvalidArgumentError(absl::StrCat("bias has ", bias_size,
                                                   " values but the convolution has ",
                                                   out_channels, " output channels"));
  }
  return absl::OkStatus();
}

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_FUSED_CONV_FUSED_CONV_ATTRS_H_
