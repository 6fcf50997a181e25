// CudnnConvolution's setup, device memory, layout copies and execution of a plan, and
// RunConvolution; which algorithm runs and how all of them are timed live beside it
// (convolution_algorithm.cc, convolution_profile.cc).
#include "cc/cudnn/convolution.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/cudnn/accumulate.h"
#include "cc/cudnn/environment.h"
#include "cc/cudnn/types.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/logging.h"

namespace tf_ucudnn {

CudnnConvolution::CudnnConvolution(ConvResources* resources, ConvKernel kernel,
                                   const ConvGeometry& g, cudnnDataType_t type,
                                   ConvBuffers<void> buffers, ConvForm form,
                                   FilterLayout filter_layout)
    : resources_(resources),
      kernel_(kernel),
      g_(g),
      type_(type),
      layout_(g, type == CUDNN_DATA_DOUBLE, form),
      filter_layout_(filter_layout),
      buffers_(buffers) {}

absl::Status CudnnConvolution::Prepare(const std::vector<MicroBatch>& micro_batches,
                                       std::vector<ResolvedCall>* calls, size_t* scratch_bytes) {
  micro_batches_ = micro_batches;
  size_t workspace_bytes = 0;
  TF_RETURN_IF_ERROR(ResolveAll(calls, &workspace_bytes));
  *scratch_bytes = PackedBytes(BufferSizes(workspace_bytes));
  return absl::OkStatus();
}

absl::Status CudnnConvolution::Run(const std::vector<MicroBatch>& micro_batches) {
  micro_batches_ = micro_batches;
  if (micro_batches_.empty()) return ZeroResultOfEmptyBatch();
  std::vector<ResolvedCall> calls;
  size_t workspace_bytes = 0;
  TF_RETURN_IF_ERROR(ResolveAll(&calls, &workspace_bytes));
  TF_RETURN_IF_ERROR(AllocateBuffers(workspace_bytes));
  const bool copies_filter = filter_layout_ == FilterLayout::kTensorFlow;
  if (!copies_filter) cudnn_filter_ = buffers_.filter;
  if (copies_filter && kernel_ != ConvKernel::kBackpropFilter) {
    TF_RETURN_IF_ERROR(Copy(layout_.FilterToCudnn(), buffers_.filter, cudnn_filter_));
  }
  for (size_t i = 0; i < micro_batches_.size(); ++i) {
    TF_RETURN_IF_ERROR(Execute(i, calls[i]));
  }
  if (copies_filter && kernel_ == ConvKernel::kBackpropFilter) {
    TF_RETURN_IF_ERROR(Copy(layout_.FilterFromCudnn(), cudnn_filter_, buffers_.filter));
  }
  return absl::OkStatus();
}

absl::Status CudnnConvolution::Begin() {
  stream_ = resources_->stream();
  if (buffers_.filter != nullptr) {
    TF_RETURN_IF_ERROR(DeviceOfPointer(buffers_.filter, &device_));
  } else {
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device_), "cudaGetDevice");
  }
  TF_RETURN_IF_ERROR(scoped_device_.Enter(device_));
  TF_RETURN_IF_ERROR(AcquireCudnnHandle(device_, stream_, &handle_));
  TF_RETURN_IF_ERROR(filter_desc_.Init(type_, layout_.channels_last(), layout_.FilterDims()));
  return conv_desc_.Init(layout_.symmetric_padding(), layout_.strides(), g_.dilations,
                         ComputeType(type_), TensorFlowMath(type_), g_.groups);
}

absl::Status CudnnConvolution::Descriptors(int64_t size, SizeDescriptors** out) {
  std::unique_ptr<SizeDescriptors>& slot = descriptors_[size];
  if (slot == nullptr) {
    auto created = std::make_unique<SizeDescriptors>();
    TF_RETURN_IF_ERROR(
        created->input.Init(type_, layout_.channels_last(), layout_.InputDims(size)));
    TF_RETURN_IF_ERROR(
        created->output.Init(type_, layout_.channels_last(), layout_.OutputDims(size)));
    slot = std::move(created);
  }
  *out = slot.get();
  return absl::OkStatus();
}

// The layout was chosen for the whole plan: the plan must run as the layout does.
absl::Status CudnnConvolution::CheckForm() const {
  ConvForm planned = ConvForm::kDirect;
  TF_RETURN_IF_ERROR(PlanForm(g_, micro_batches_, &planned));
  if (planned == layout_.form()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("the plan runs ", FormName(planned),
                                                 ", but this convolution runs ",
                                                 FormName(layout_.form())));
}

absl::Status CudnnConvolution::ResolveAll(std::vector<ResolvedCall>* calls,
                                          size_t* workspace_bytes) {
  TF_RETURN_IF_ERROR(CheckForm());
  if (filter_layout_ == FilterLayout::kCudnn && layout_.FilterMinorToMajor().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a filter in cuDNN's layout cannot run ", FormName(layout_.form()),
        ": cuDNN's filter there is not a permutation of TensorFlow's"));
  }
  TF_RETURN_IF_ERROR(Begin());
  calls->clear();
  *workspace_bytes = 0;
  for (size_t i = 0; i < micro_batches_.size(); ++i) {
    ResolvedCall call;
    TF_RETURN_IF_ERROR(CachedResolve(i, &call));
    *workspace_bytes = std::max(*workspace_bytes, call.workspace);
    calls->push_back(call);
  }
  return absl::OkStatus();
}

// A mini-batch of zero samples still has a (zero) filter gradient.
absl::Status CudnnConvolution::ZeroResultOfEmptyBatch() {
  if (kernel_ != ConvKernel::kBackpropFilter || g_.FilterSize() == 0) return absl::OkStatus();
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(buffers_.filter, 0, g_.FilterSize() * ElementSize(type_),
                      resources_->stream()),
      "cudaMemsetAsync");
  return absl::OkStatus();
}

// Bytes of the workspace, cuDNN's copy of the filter (none where the op's is in cuDNN's layout),
// its copy of the input (padded, transposed or in another form), the transposed output, in the
// order AllocateBuffers takes them.
std::vector<size_t> CudnnConvolution::BufferSizes(size_t workspace_bytes) const {
  int64_t largest = 0;
  for (const MicroBatch& mb : micro_batches_) largest = std::max(largest, mb.size);
  const size_t element = ElementSize(type_);
  const bool copies_filter = filter_layout_ == FilterLayout::kTensorFlow;
  return {workspace_bytes, copies_filter ? layout_.FilterElements() * element : 0,
          layout_.needs_input_copy() ? largest * layout_.PaddedInputSampleSize() * element : 0,
          layout_.transposed() ? largest * g_.OutputSampleSize() * element : 0,
          AccumulatesEngineFilters() ? layout_.FilterElements() * element : 0};
}

// Whether an engine computes a filter gradient after the first micro-batch's: engines have no
// beta to add to their output, so theirs go to a buffer of their own and are added after.
bool CudnnConvolution::AccumulatesEngineFilters() const {
  if (kernel_ != ConvKernel::kBackpropFilter) return false;
  for (size_t i = 1; i < micro_batches_.size(); ++i) {
    if (micro_batches_[i].algorithm.is_engine()) return true;
  }
  return false;
}

absl::Status CudnnConvolution::AllocateBuffers(size_t workspace_bytes) {
  const std::vector<size_t> sizes = BufferSizes(workspace_bytes);
  void** buffers[] = {&workspace_, &cudnn_filter_, &cudnn_input_, &cudnn_output_,
                      &engine_filter_};
  for (size_t i = 0; i < sizes.size(); ++i) {
    *buffers[i] = nullptr;
    if (sizes[i] > 0) TF_RETURN_IF_ERROR(resources_->Allocate(sizes[i], buffers[i]));
  }
  return absl::OkStatus();
}

absl::Status CudnnConvolution::AllocateElements(int64_t elements, void** memory) {
  return resources_->Allocate(elements * ElementSize(type_), memory);
}

void* CudnnConvolution::Element(void* base, int64_t index) const {
  return static_cast<char*>(base) + index * static_cast<int64_t>(ElementSize(type_));
}

absl::Status CudnnConvolution::Copy(const StridedCopy& copy, const void* src, void* dst) {
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(
      LaunchStridedCopy(copy, src, dst, static_cast<int>(ElementSize(type_)), stream_),
      "layout copy kernel");
  return absl::OkStatus();
}

// The input and output cuDNN works on for `size` samples at `input` and `output`: those tensors,
// or cuDNN's padded or transposed copies of them, filled where the kernel reads them.
absl::Status CudnnConvolution::CudnnOperands(void* input, void* output, int64_t size,
                                             void** cudnn_input, void** cudnn_output) {
  *cudnn_input = layout_.needs_input_copy() ? cudnn_input_ : input;
  if (layout_.needs_input_copy() && kernel_ != ConvKernel::kBackpropInput) {
    TF_RETURN_IF_ERROR(Copy(layout_.InputCopy(size, /*to_cudnn=*/true), input, *cudnn_input));
  }
  *cudnn_output = layout_.transposed() ? cudnn_output_ : output;
  if (layout_.transposed() && kernel_ != ConvKernel::kForward) {
    TF_RETURN_IF_ERROR(Copy(layout_.OutputCopy(size, /*to_cudnn=*/true), output, *cudnn_output));
  }
  return absl::OkStatus();
}

absl::Status CudnnConvolution::Execute(size_t index, const ResolvedCall& call) {
  const MicroBatch& mb = micro_batches_[index];
  SizeDescriptors* d;
  TF_RETURN_IF_ERROR(Descriptors(mb.size, &d));
  TF_RETURN_IF_ERROR(conv_desc_.SetMath(call.math));
  void* input = Element(buffers_.input, mb.offset * g_.InputSampleSize());
  void* output = Element(buffers_.output, mb.offset * g_.OutputSampleSize());
  void* cudnn_input;
  void* cudnn_output;
  TF_RETURN_IF_ERROR(CudnnOperands(input, output, mb.size, &cudnn_input, &cudnn_output));
  void* workspace = call.workspace > 0 ? workspace_ : nullptr;
  if (mb.algorithm.is_engine()) {
    TF_RETURN_IF_ERROR(ExecuteEngineCall(index, cudnn_input, cudnn_output, workspace));
    return CopyResultBack(index, cudnn_input, input, cudnn_output, output);
  }
  const void* one = ScaleFactor(type_, 1);
  // Filter gradients of all micro-batches add up in place.
  const void* beta =
      kernel_ == ConvKernel::kBackpropFilter && index > 0 ? one : ScaleFactor(type_, 0);
  cudnnHandle_t h = handle_.get();
  cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
  switch (kernel_) {
    case ConvKernel::kForward:
      status = cudnnConvolutionForward(
          h, one, d->input.get(), cudnn_input, filter_desc_.get(), cudnn_filter_,
          conv_desc_.get(), static_cast<cudnnConvolutionFwdAlgo_t>(call.algo), workspace,
          call.workspace, beta, d->output.get(), cudnn_output);
      break;
    case ConvKernel::kBackpropInput:
      status = cudnnConvolutionBackwardData(
          h, one, filter_desc_.get(), cudnn_filter_, d->output.get(), cudnn_output,
          conv_desc_.get(), static_cast<cudnnConvolutionBwdDataAlgo_t>(call.algo), workspace,
          call.workspace, beta, d->input.get(), cudnn_input);
      break;
    case ConvKernel::kBackpropFilter:
      status = cudnnConvolutionBackwardFilter(
          h, one, d->input.get(), cudnn_input, d->output.get(), cudnn_output, conv_desc_.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(call.algo), workspace, call.workspace,
          beta, filter_desc_.get(), cudnn_filter_);
      break;
  }
  if (LogCalls()) {
    LOG(INFO) << resources_->label() << " " << KernelName(kernel_) << " cuDNN call " << index + 1
              << "/" << micro_batches_.size() << ": " << mb.size << " samples at " << mb.offset
              << ", algo=" << call.algo << ",math=" << MathName(call.math) << ", workspace "
              << call.workspace << " bytes: " << cudnnGetErrorString(status);
  }
  if (status != CUDNN_STATUS_SUCCESS) {
    return FromCudnn(status, absl::StrCat(Where(index), ": cuDNN ", KernelName(kernel_),
                                          " with algorithm ", AlgorithmText(call.algo), " and ",
                                          MathName(call.math), " math failed for ",
                                          g_.DebugString()));
  }
  return CopyResultBack(index, cudnn_input, input, cudnn_output, output);
}

// The micro-batch's result, from cuDNN's copy where cuDNN works on one, to the op's tensor.
absl::Status CudnnConvolution::CopyResultBack(size_t index, void* cudnn_input, void* input,
                                              void* cudnn_output, void* output) {
  const MicroBatch& mb = micro_batches_[index];
  if (layout_.needs_input_copy() && kernel_ == ConvKernel::kBackpropInput) {
    TF_RETURN_IF_ERROR(CopyInputGradientBack(mb.size, cudnn_input, input));
  }
  if (layout_.transposed() && kernel_ == ConvKernel::kForward) {
    TF_RETURN_IF_ERROR(
        Copy(layout_.OutputCopy(mb.size, /*to_cudnn=*/false), cudnn_output, output));
  }
  return absl::OkStatus();
}

// A micro-batch's input gradient, from cuDNN's copy to the op's tensor; the input a form leaves out
// (the convolution does not read it) gets zeros.
absl::Status CudnnConvolution::CopyInputGradientBack(int64_t size, void* cudnn_input,
                                                     void* input) {
  if (!layout_.covers_input()) {
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(input, 0, size * g_.InputSampleSize() * ElementSize(type_), stream_),
        "cudaMemsetAsync");
  }
  return Copy(layout_.InputCopy(size, /*to_cudnn=*/false), cudnn_input, input);
}

absl::Status CudnnConvolution::ExecuteEngineCall(size_t index, void* cudnn_input,
                                                 void* cudnn_output, void* workspace) {
  const MicroBatch& mb = micro_batches_[index];
  // Filter gradients of all micro-batches add up: the first in place, the others beside it.
  const bool beside = kernel_ == ConvKernel::kBackpropFilter && index > 0;
  void* filter = beside ? engine_filter_ : cudnn_filter_;
  absl::Status status = ExecuteEngine(handle_.get(), Problem(mb.size), mb.algorithm, cudnn_input,
                                      filter, cudnn_output, workspace);
  if (LogCalls()) {
    LOG(INFO) << resources_->label() << " " << KernelName(kernel_) << " cuDNN call " << index + 1
              << "/" << micro_batches_.size() << ": " << mb.size << " samples at " << mb.offset
              << ", " << mb.algorithm.ToString() << ": " << status;
  }
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat(Where(index), ": ", status.message(),
                                                    " for ", g_.DebugString()));
  }
  if (!beside) return absl::OkStatus();
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(
      LaunchAccumulate(engine_filter_, cudnn_filter_, layout_.FilterElements(),
                       AccumulatedTypeOf(type_), stream_),
      absl::StrCat(Where(index), ": adding its filter gradient"));
  return absl::OkStatus();
}

std::string CudnnConvolution::Where(size_t index) const {
  const MicroBatch& mb = micro_batches_[index];
  return absl::StrCat("micro-batch ", index, " (samples ", mb.offset, "..",
                      mb.offset + mb.size - 1, ")");
}

std::string CudnnConvolution::AlgorithmText(int algo) const {
  return absl::StrCat(algo, " (", AlgorithmName(kernel_, algo), ")");
}

absl::Status RunConvolution(ConvResources* resources, ConvKernel kernel,
                            const ConvGeometry& geometry,
                            const std::vector<MicroBatch>& micro_batches, cudnnDataType_t type,
                            ConvBuffers<void> buffers, FilterLayout filter_layout) {
  // Zero-sized dims leave nothing for cuDNN to compute; the result is zeros (or empty).
  if (geometry.FilterSize() == 0 || geometry.InputSampleSize() == 0 ||
      geometry.OutputSampleSize() == 0) {
    const int64_t elements =
        kernel == ConvKernel::kForward
            ? geometry.batch * geometry.OutputSampleSize()
            : kernel == ConvKernel::kBackpropInput ? geometry.batch * geometry.InputSampleSize()
                                                   : geometry.FilterSize();
    void* result = kernel == ConvKernel::kForward         ? buffers.output
                   : kernel == ConvKernel::kBackpropInput ? buffers.input
                                                          : buffers.filter;
    if (elements == 0) return absl::OkStatus();
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(result, 0, elements * ElementSize(type), resources->stream()),
        "cudaMemsetAsync");
    return absl::OkStatus();
  }
  ConvForm form = ConvForm::kDirect;
  TF_RETURN_IF_ERROR(PlanForm(geometry, micro_batches, &form));
  return CudnnConvolution(resources, kernel, geometry, type, buffers, form, filter_layout)
      .Run(micro_batches);
}

}  // namespace tf_ucudnn
