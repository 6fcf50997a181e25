// The fused convolution's cuDNN calls: one cudnnConvolutionBiasActivationForward per micro-batch
// on the op's tensors (or cc/cudnn's padded or transposed copies of them, as its layout asks).
#include "cc/fused_conv/cudnn_fused_convolution.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/cudnn/convolution.h"
#include "cc/cudnn/cudnn_support.h"
#include "cc/cudnn/environment.h"
#include "cc/cudnn/layout.h"
#include "cc/cudnn/strided_copy.h"
#include "cc/cudnn/types.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/logging.h"

namespace tf_ucudnn {
namespace {

class ActivationDescriptor {
 public:
  ActivationDescriptor() = default;
  ActivationDescriptor(const ActivationDescriptor&) = delete;
  ActivationDescriptor& operator=(const ActivationDescriptor&) = delete;
  ~ActivationDescriptor() {
    if (desc_ != nullptr) cudnnDestroyActivationDescriptor(desc_);
  }

  // The fused call takes no NaN propagation for its ReLU (as TensorFlow's fused convolutions).
  absl::Status Init(FusedActivation activation) {
    TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnCreateActivationDescriptor(&desc_),
                                    "cudnnCreateActivationDescriptor");
    const cudnnActivationMode_t mode = activation == FusedActivation::kRelu
                                           ? CUDNN_ACTIVATION_RELU
                                           : CUDNN_ACTIVATION_IDENTITY;
    TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
        cudnnSetActivationDescriptor(desc_, mode, CUDNN_NOT_PROPAGATE_NAN, 0.0),
        "cudnnSetActivationDescriptor");
    return absl::OkStatus();
  }

  cudnnActivationDescriptor_t get() const { return desc_; }

 private:
  cudnnActivationDescriptor_t desc_ = nullptr;
};

class CudnnFusedConvolution {
 public:
  // `g` must outlive the convolution.
  CudnnFusedConvolution(ConvResources* resources, const ConvGeometry& g, cudnnDataType_t type,
                        FusedActivation activation, FusedConvBuffers buffers)
      : resources_(resources),
        g_(g),
        type_(type),
        layout_(g, type == CUDNN_DATA_DOUBLE),
        activation_(activation),
        buffers_(buffers) {}

  absl::Status Run(const std::vector<MicroBatch>& micro_batches);

  // Where the input or the filter is empty the convolution is zeros: y = activation(bias).
  absl::Status RunWithoutConvolution();

 private:
  absl::Status Begin();
  absl::Status AllocateBuffers(const std::vector<ResolvedCall>& calls);
  absl::Status Copy(const StridedCopy& copy, const void* src, void* dst);
  void* Element(void* base, int64_t index) const;
  absl::Status OutputDescriptor(int64_t size, const TensorDescriptor** out);
  absl::Status Execute(size_t index, const ResolvedCall& call);
  absl::Status Finish(size_t index, const TensorDescriptor& output_desc, void* cudnn_output,
                      void* output, bool fused);
  // The bias and the activation as calls of their own, in place on `y`.
  absl::Status AddBiasAndActivate(const TensorDescriptor& y_desc, void* y);
  std::string Where(size_t index) const;

  ConvResources* resources_;
  int device_ = 0;
  const ConvGeometry& g_;
  const cudnnDataType_t type_;
  const CudnnLayout layout_;
  const FusedActivation activation_;
  FusedConvBuffers buffers_;
  std::vector<MicroBatch> micro_batches_;
  cudaStream_t stream_ = nullptr;
  ScopedCudaDevice scoped_device_;
  CudnnHandleLease handle_;
  TensorDescriptor bias_desc_;
  ActivationDescriptor activation_desc_;
  FilterDescriptor filter_desc_;
  ConvolutionDescriptor conv_desc_;
  // Per micro-batch size: cuDNN's input (padded) and output.
  std::map<int64_t, std::pair<std::unique_ptr<TensorDescriptor>,
                              std::unique_ptr<TensorDescriptor>>> descriptors_;
  void* workspace_ = nullptr;
  void* cudnn_filter_ = nullptr;
  void* cudnn_input_ = nullptr;   // padded or transposed
  void* cudnn_output_ = nullptr;  // transposed
};

absl::Status CudnnFusedConvolution::Run(const std::vector<MicroBatch>& micro_batches) {
  micro_batches_ = micro_batches;
  std::vector<ResolvedCall> calls;
  {
    // The convolution executor resolves the algorithms as UcudnnConv2D would; it lets go of its
    // cuDNN handle (held exclusively) before Begin takes it.
    CudnnConvolution convolution(resources_, ConvKernel::kForward, g_, type_,
                                 {buffers_.input, buffers_.filter, buffers_.output});
    size_t unfused_scratch_bytes = 0;
    TF_RETURN_IF_ERROR(convolution.Prepare(micro_batches_, &calls, &unfused_scratch_bytes));
  }
  TF_RETURN_IF_ERROR(Begin());
  TF_RETURN_IF_ERROR(filter_desc_.Init(type_, layout_.channels_last(), layout_.FilterDims()));
  TF_RETURN_IF_ERROR(conv_desc_.Init(layout_.symmetric_padding(), g_.strides, g_.dilations,
                                     ComputeType(type_), TensorFlowMath(type_), g_.groups));
  TF_RETURN_IF_ERROR(AllocateBuffers(calls));
  TF_RETURN_IF_ERROR(Copy(layout_.FilterToCudnn(), buffers_.filter, cudnn_filter_));
  for (size_t i = 0; i < micro_batches_.size(); ++i) {
    TF_RETURN_IF_ERROR(Execute(i, calls[i]));
  }
  return absl::OkStatus();
}

absl::Status CudnnFusedConvolution::RunWithoutConvolution() {
  TF_RETURN_IF_ERROR(Begin());
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(buffers_.output, 0, g_.batch * g_.OutputSampleSize() * ElementSize(type_),
                      stream_),
      "cudaMemsetAsync");
  TensorDescriptor output;
  std::vector<int64_t> dims = {g_.batch, g_.out_channels};
  dims.insert(dims.end(), g_.output_spatial.begin(), g_.output_spatial.end());
  TF_RETURN_IF_ERROR(output.Init(type_, g_.channels_last, dims));
  return AddBiasAndActivate(output, buffers_.output);
}

// The stream, the device (the output's: never empty here), the handle, and the descriptors that
// do not depend on the micro-batch.
absl::Status CudnnFusedConvolution::Begin() {
  stream_ = resources_->stream();
  TF_RETURN_IF_ERROR(DeviceOfPointer(buffers_.output, &device_));
  TF_RETURN_IF_ERROR(scoped_device_.Enter(device_));
  TF_RETURN_IF_ERROR(AcquireCudnnHandle(device_, stream_, &handle_));
  std::vector<int64_t> bias_dims(g_.num_spatial_dims() + 2, 1);
  bias_dims[1] = g_.out_channels;
  TF_RETURN_IF_ERROR(bias_desc_.Init(type_, /*channels_last=*/false, bias_dims));
  return activation_desc_.Init(activation_);
}

// The workspace the largest call needs, cuDNN's copy of the filter, and the padded (or
// transposed) input and transposed output of the largest micro-batch, as the layout asks.
absl::Status CudnnFusedConvolution::AllocateBuffers(const std::vector<ResolvedCall>& calls) {
  size_t workspace_bytes = 0;
  for (const ResolvedCall& call : calls) {
    workspace_bytes = std::max(workspace_bytes, call.workspace);
  }
  int64_t largest = 0;
  for (const MicroBatch& mb : micro_batches_) largest = std::max(largest, mb.size);
  const size_t element = ElementSize(type_);
  const std::pair<size_t, void**> buffers[] = {
      {workspace_bytes, &workspace_},
      {g_.FilterSize() * element, &cudnn_filter_},
      {layout_.needs_input_copy() ? largest * layout_.PaddedInputSampleSize() * element : 0,
       &cudnn_input_},
      {layout_.transposed() ? largest * g_.OutputSampleSize() * element : 0, &cudnn_output_}};
  for (const auto& [bytes, memory] : buffers) {
    *memory = nullptr;
    if (bytes > 0) TF_RETURN_IF_ERROR(resources_->Allocate(bytes, memory));
  }
  return absl::OkStatus();
}

absl::Status CudnnFusedConvolution::Copy(const StridedCopy& copy, const void* src, void* dst) {
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(
      LaunchStridedCopy(copy, src, dst, static_cast<int>(ElementSize(type_)), stream_),
      "layout copy kernel");
  return absl::OkStatus();
}

void* CudnnFusedConvolution::Element(void* base, int64_t index) const {
  return static_cast<char*>(base) + index * static_cast<int64_t>(ElementSize(type_));
}

absl::Status CudnnFusedConvolution::Execute(size_t index, const ResolvedCall& call) {
  const MicroBatch& mb = micro_batches_[index];
  auto& [input_desc, output_desc] = descriptors_[mb.size];
  if (input_desc == nullptr) {
    auto input = std::make_unique<TensorDescriptor>();
    auto output = std::make_unique<TensorDescriptor>();
    TF_RETURN_IF_ERROR(input->Init(type_, layout_.channels_last(), layout_.InputDims(mb.size)));
    TF_RETURN_IF_ERROR(
        output->Init(type_, layout_.channels_last(), layout_.OutputDims(mb.size)));
    input_desc = std::move(input);
    output_desc = std::move(output);
  }
  TF_RETURN_IF_ERROR(conv_desc_.SetMath(call.math));
  void* input = Element(buffers_.input, mb.offset * g_.InputSampleSize());
  void* output = Element(buffers_.output, mb.offset * g_.OutputSampleSize());
  void* cudnn_input = layout_.needs_input_copy() ? cudnn_input_ : input;
  void* cudnn_output = layout_.transposed() ? cudnn_output_ : output;
  if (layout_.needs_input_copy()) {
    TF_RETURN_IF_ERROR(Copy(layout_.InputCopy(mb.size, /*to_cudnn=*/true), input, cudnn_input));
  }
  void* workspace = call.workspace > 0 ? workspace_ : nullptr;
  if (mb.algorithm.is_engine()) {
    // An engine configuration runs the convolution alone; the bias and activation follow.
    const EngineProblem problem =
        EngineProblemOf(ConvKernel::kForward, g_, layout_, type_, mb.size, device_);
    absl::Status status = ExecuteEngine(handle_.get(), problem, mb.algorithm, cudnn_input,
                                        cudnn_filter_, cudnn_output, workspace);
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat(Where(index), ": ", status.message(),
                                                      " for ", g_.DebugString()));
    }
    return Finish(index, *output_desc, cudnn_output, output, /*fused=*/false);
  }
  const auto algo = static_cast<cudnnConvolutionFwdAlgo_t>(call.algo);
  const void* one = ScaleFactor(type_, 1);
  const void* zero = ScaleFactor(type_, 0);
  cudnnHandle_t h = handle_.get();
  const bool fused = activation_ != FusedActivation::kIdentity ||
                     algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
  cudnnStatus_t status;
  if (fused) {
    // alpha2 = 0: no side input z; cuDNN does not read it, and y stands in for it.
    status = cudnnConvolutionBiasActivationForward(
        h, one, input_desc->get(), cudnn_input, filter_desc_.get(), cudnn_filter_,
        conv_desc_.get(), algo, workspace, call.workspace, zero, output_desc->get(),
        cudnn_output, bias_desc_.get(), buffers_.bias, activation_desc_.get(),
        output_desc->get(), cudnn_output);
  } else {
    status = cudnnConvolutionForward(h, one, input_desc->get(), cudnn_input, filter_desc_.get(),
                                     cudnn_filter_, conv_desc_.get(), algo, workspace,
                                     call.workspace, zero, output_desc->get(), cudnn_output);
  }
  if (LogCalls()) {
    LOG(INFO) << resources_->label() << " " << (fused ? "fused" : "convolution, then bias")
              << " cuDNN call " << index + 1 << "/" << micro_batches_.size() << ": " << mb.size
              << " samples at " << mb.offset << ", algo=" << call.algo
              << ",math=" << MathName(call.math) << ", " << ActivationName(activation_)
              << ", workspace " << call.workspace << " bytes: " << cudnnGetErrorString(status);
  }
  if (status != CUDNN_STATUS_SUCCESS) {
    return FromCudnn(status, absl::StrCat(Where(index), ": cuDNN ",
                                          fused ? "fused convolution, bias and " : "convolution (",
                                          ActivationName(activation_), fused ? "" : ")",
                                          " with algorithm ", call.algo, " (",
                                          AlgorithmName(ConvKernel::kForward, call.algo),
                                          ") and ", MathName(call.math), " math failed for ",
                                          g_.DebugString()));
  }
  return Finish(index, *output_desc, cudnn_output, output, fused);
}

// The bias and activation where the call did not fuse them, and the result to the op's tensor.
absl::Status CudnnFusedConvolution::Finish(size_t index, const TensorDescriptor& output_desc,
                                           void* cudnn_output, void* output, bool fused) {
  if (!fused) {
    TF_RETURN_IF_ERROR(AddBiasAndActivate(output_desc, cudnn_output));
  }
  if (layout_.transposed()) {
    TF_RETURN_IF_ERROR(Copy(layout_.OutputCopy(micro_batches_[index].size, /*to_cudnn=*/false),
                            cudnn_output, output));
  }
  return absl::OkStatus();
}

absl::Status CudnnFusedConvolution::AddBiasAndActivate(const TensorDescriptor& y_desc, void* y) {
  const void* one = ScaleFactor(type_, 1);
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
      cudnnAddTensor(handle_.get(), one, bias_desc_.get(), buffers_.bias, one, y_desc.get(), y),
      "cudnnAddTensor (the bias)");
  if (activation_ == FusedActivation::kIdentity) return absl::OkStatus();
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
      cudnnActivationForward(handle_.get(), activation_desc_.get(), one, y_desc.get(), y,
                             ScaleFactor(type_, 0), y_desc.get(), y),
      "cudnnActivationForward");
  return absl::OkStatus();
}

std::string CudnnFusedConvolution::Where(size_t index) const {
  const MicroBatch& mb = micro_batches_[index];
  return absl::StrCat("micro-batch ", index, " (samples ", mb.offset, "..",
                      mb.offset + mb.size - 1, ")");
}

}  // namespace

absl::Status RunFusedConvolution(ConvResources* resources, const ConvGeometry& geometry,
                                 const std::vector<MicroBatch>& micro_batches,
                                 cudnnDataType_t type, FusedActivation activation,
                                 FusedConvBuffers buffers) {
  if (geometry.batch * geometry.OutputSampleSize() == 0) return absl::OkStatus();
  CudnnFusedConvolution convolution(resources, geometry, type, activation, buffers);
  if (geometry.FilterSize() == 0 || geometry.InputSampleSize() == 0) {
    return convolution.RunWithoutConvolution();
  }
  return convolution.Run(micro_batches);
}

}  // namespace tf_ucudnn
