// Where a convolution's cuDNN calls run: the stream, and the device memory for their workspace
// and layout copies. An op kernel takes TensorFlow's temporaries (op_kernel_resources.h); an XLA
// custom call carves them out of the one scratch buffer XLA allocated for it (ScratchResources).
#ifndef TF_UCUDNN_CC_CUDNN_CONV_RESOURCES_H_
#define TF_UCUDNN_CC_CUDNN_CONV_RESOURCES_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tf_ucudnn {

class ConvResources {
 public:
  virtual ~ConvResources() = default;
  // The stream every call is queued on; nullptr where nothing runs (planning at compile time).
  virtual cudaStream_t stream() = 0;
  // `bytes` of device memory, alive until the resources go.
  virtual absl::Status Allocate(size_t bytes, void** memory) = 0;
  // Names the op in logs and errors.
  virtual std::string label() const = 0;
};

// Offsets of device buffers packed one after another, each aligned as cuDNN wants its operands.
inline size_t AlignedBytes(size_t bytes) {
  constexpr size_t kAlignment = 256;
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

inline size_t PackedBytes(const std::vector<size_t>& buffers) {
  size_t total = 0;
  for (size_t bytes : buffers) total += AlignedBytes(bytes);
  return total;
}

// A buffer allocated by someone else (XLA), handed out front to back.
class ScratchResources : public ConvResources {
 public:
  ScratchResources(cudaStream_t stream, void* scratch, size_t scratch_bytes, std::string label)
      : stream_(stream), next_(static_cast<char*>(scratch)), left_(scratch_bytes),
        label_(std::move(label)) {}

  cudaStream_t stream() override { return stream_; }

  absl::Status Allocate(size_t bytes, void** memory) override {
    const size_t aligned = AlignedBytes(bytes);
    if (aligned > left_) {
      return absl::InternalError(absl::StrCat(
          label_, ": the scratch buffer planned at compile time has ", left_,
          " bytes left, but the convolution needs ", aligned, " more"));
    }
    *memory = next_;
    next_ += aligned;
    left_ -= aligned;
    return absl::OkStatus();
  }

  std::string label() const override { return label_; }

 private:
  cudaStream_t stream_;
  char* next_;
  size_t left_;
  std::string label_;
};

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_CONV_RESOURCES_H_
