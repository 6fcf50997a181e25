// The cuDNN plumbing of cudnn_support.h: status conversions, the handle pool and descriptors.
#include "cc/cudnn/cudnn_support.h"

#include <algorithm>
#include <climits>
#include <map>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tf_ucudnn {
namespace {

absl::Status ToInts(const std::vector<int64_t>& values, const char* what, std::vector<int>* out) {
  out->clear();
  for (int64_t value : values) {
    if (value > INT_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " dimension ", value, " exceeds what cuDNN accepts (", INT_MAX, ")"));
    }
    out->push_back(static_cast<int>(value));
  }
  return absl::OkStatus();
}

struct PooledHandle {
  std::mutex mutex;
  cudnnHandle_t handle = nullptr;
};

}  // namespace

absl::Status FromCudnn(cudnnStatus_t status, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", cudnnGetErrorString(status));
  switch (status) {
    case CUDNN_STATUS_NOT_SUPPORTED:
    case CUDNN_STATUS_BAD_PARAM:
      return absl::InvalidArgumentError(message);
    case CUDNN_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status FromCuda(cudaError_t error, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

absl::Status ScopedCudaDevice::Enter(int device) {
  int current = -1;
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) {
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
    previous_ = current;
  }
  return absl::OkStatus();
}

namespace {

// Two CUDA events, destroyed with it.
class EventPair {
 public:
  absl::Status Create() {
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&start_), "cudaEventCreate");
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&stop_), "cudaEventCreate");
    return absl::OkStatus();
  }
  ~EventPair() {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
  }
  cudaEvent_t start() const { return start_; }
  cudaEvent_t stop() const { return stop_; }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

}  // namespace

absl::Status MedianGpuTime(cudaStream_t stream, int repeats,
                           const std::function<absl::Status()>& work, float* time_ms) {
  EventPair events;
  if (absl::Status status = events.Create(); !status.ok()) return status;
  if (absl::Status status = work(); !status.ok()) return status;
  std::vector<float> times;
  for (int r = 0; r < repeats; ++r) {
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaEventRecord(events.start(), stream), "cudaEventRecord");
    if (absl::Status status = work(); !status.ok()) return status;
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaEventRecord(events.stop(), stream), "cudaEventRecord");
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(events.stop()), "cudaEventSynchronize");
    float ms = 0;
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, events.start(), events.stop()),
                                   "cudaEventElapsedTime");
    times.push_back(ms);
  }
  if (times.empty()) return absl::InvalidArgumentError("timing needs at least one run");
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  *time_ms = times[times.size() / 2];
  return absl::OkStatus();
}

absl::Status DeviceOfPointer(const void* pointer, int* device) {
  cudaPointerAttributes attributes;
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaPointerGetAttributes(&attributes, pointer),
                                 "cudaPointerGetAttributes");
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    return absl::InternalError("a tensor of a GPU kernel is not in device memory");
  }
  *device = attributes.device;
  return absl::OkStatus();
}

absl::Status AcquireCudnnHandle(int device, cudaStream_t stream, CudnnHandleLease* lease) {
  static std::mutex* pool_mutex = new std::mutex;
  static auto* pool = new std::map<std::pair<int, cudaStream_t>, std::unique_ptr<PooledHandle>>;
  PooledHandle* entry;
  {
    std::lock_guard<std::mutex> lock(*pool_mutex);
    std::unique_ptr<PooledHandle>& slot = (*pool)[{device, stream}];
    if (slot == nullptr) {
      auto created = std::make_unique<PooledHandle>();
      TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnCreate(&created->handle), "cudnnCreate");
      TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnSetStream(created->handle, stream), "cudnnSetStream");
      slot = std::move(created);
    }
    entry = slot.get();
  }
  lease->lock_ = std::unique_lock<std::mutex>(entry->mutex);
  lease->handle_ = entry->handle;
  return absl::OkStatus();
}

TensorDescriptor::~TensorDescriptor() {
  if (desc_ != nullptr) cudnnDestroyTensorDescriptor(desc_);
}

absl::Status TensorDescriptor::Init(cudnnDataType_t type, bool channels_last,
                                    const std::vector<int64_t>& dims) {
  std::vector<int> int_dims;
  if (absl::Status status = ToInts(dims, "tensor", &int_dims); !status.ok()) return status;
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&desc_),
                                  "cudnnCreateTensorDescriptor");
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
      cudnnSetTensorNdDescriptorEx(desc_, channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                   type, static_cast<int>(int_dims.size()), int_dims.data()),
      "cudnnSetTensorNdDescriptorEx");
  return absl::OkStatus();
}

FilterDescriptor::~FilterDescriptor() {
  if (desc_ != nullptr) cudnnDestroyFilterDescriptor(desc_);
}

absl::Status FilterDescriptor::Init(cudnnDataType_t type, bool channels_last,
                                    const std::vector<int64_t>& dims) {
  std::vector<int> int_dims;
  if (absl::Status status = ToInts(dims, "filter", &int_dims); !status.ok()) return status;
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnCreateFilterDescriptor(&desc_),
                                  "cudnnCreateFilterDescriptor");
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
      cudnnSetFilterNdDescriptor(desc_, type, channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                 static_cast<int>(int_dims.size()), int_dims.data()),
      "cudnnSetFilterNdDescriptor");
  return absl::OkStatus();
}

ConvolutionDescriptor::~ConvolutionDescriptor() {
  if (desc_ != nullptr) cudnnDestroyConvolutionDescriptor(desc_);
}

absl::Status ConvolutionDescriptor::Init(const std::vector<int64_t>& pads,
                                         const std::vector<int64_t>& strides,
                                         const std::vector<int64_t>& dilations,
                                         cudnnDataType_t compute_type, cudnnMathType_t math,
                                         int64_t groups) {
  std::vector<int> int_pads, int_strides, int_dilations;
  for (auto [values, name, out] : {std::make_tuple(&pads, "padding", &int_pads),
                                   std::make_tuple(&strides, "stride", &int_strides),
                                   std::make_tuple(&dilations, "dilation", &int_dilations)}) {
    if (absl::Status status = ToInts(*values, name, out); !status.ok()) return status;
  }
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnCreateConvolutionDescriptor(&desc_),
                                  "cudnnCreateConvolutionDescriptor");
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
      cudnnSetConvolutionNdDescriptor(desc_, static_cast<int>(int_pads.size()), int_pads.data(),
                                      int_strides.data(), int_dilations.data(),
                                      CUDNN_CROSS_CORRELATION, compute_type),
      "cudnnSetConvolutionNdDescriptor");
  // The groups divide the input's channels, which the tensor descriptor holds as an int.
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
      cudnnSetConvolutionGroupCount(desc_, static_cast<int>(groups)),
      "cudnnSetConvolutionGroupCount");
  return SetMath(math);
}

absl::Status ConvolutionDescriptor::SetMath(cudnnMathType_t math) {
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(desc_, math),
                                  "cudnnSetConvolutionMathType");
  return absl::OkStatus();
}

}  // namespace tf_ucudnn
