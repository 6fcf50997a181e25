// CudnnConvolution::Profile: times every legacy algorithm (cudnnFind*AlgorithmEx) or every engine
// configuration on the op's own tensors, through the same descriptors, layout copies and math as
// Run, for the profiler's table.
#include "cc/cudnn/convolution.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/cudnn/types.h"
#include "tensorflow/core/platform/errors.h"

namespace tf_ucudnn {
namespace {

// Runs per engine configuration (and per form's copy) after its warm-up; the median is kept.
constexpr int kEngineTimingRepeats = 5;

}  // namespace

absl::Status CudnnConvolution::Profile(const std::vector<int64_t>& sizes, size_t workspace_limit,
                                       ProfiledCandidates candidates,
                                       std::vector<AlgorithmMeasurement>* measurements) {
  micro_batches_.clear();
  for (int64_t size : sizes) {
    if (size < 1 || size > g_.batch) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot profile a micro-batch of ", size, " samples of a batch of ", g_.batch));
    }
    micro_batches_.push_back({0, size, AlgorithmSpec()});
  }
  if (micro_batches_.empty()) return absl::OkStatus();
  TF_RETURN_IF_ERROR(Begin());
  TF_RETURN_IF_ERROR(AllocateBuffers(workspace_limit));
  int64_t largest = 0;
  for (int64_t size : sizes) largest = std::max(largest, size);
  // Results go to scratch; operands are copied where cuDNN needs another layout or padding. (A
  // forward result cuDNN writes transposed stays in cuDNN's copy, unless a form's copies are
  // timed: those write the op's layout too.)
  if (kernel_ == ConvKernel::kForward &&
      (!layout_.transposed() || layout_.form() != ConvForm::kDirect)) {
    TF_RETURN_IF_ERROR(AllocateElements(largest * g_.OutputSampleSize(), &buffers_.output));
  } else if (kernel_ == ConvKernel::kBackpropInput &&
             (!layout_.needs_input_copy() || layout_.form() != ConvForm::kDirect)) {
    TF_RETURN_IF_ERROR(AllocateElements(largest * g_.InputSampleSize(), &buffers_.input));
  }
  if (kernel_ != ConvKernel::kBackpropFilter) {
    TF_RETURN_IF_ERROR(Copy(layout_.FilterToCudnn(), buffers_.filter, cudnn_filter_));
  }
  void* cudnn_input;
  void* cudnn_output;
  TF_RETURN_IF_ERROR(
      CudnnOperands(buffers_.input, buffers_.output, largest, &cudnn_input, &cudnn_output));
  TF_RETURN_IF_ERROR(conv_desc_.SetMath(TensorFlowMath(type_)));
  void* workspace = workspace_limit > 0 ? workspace_ : nullptr;
  for (int64_t size : sizes) {
    const size_t first = measurements->size();
    if (candidates == ProfiledCandidates::kEngines) {
      TF_RETURN_IF_ERROR(
          TimeEngines(cudnn_input, cudnn_output, workspace, workspace_limit, size, measurements));
    } else {
      SizeDescriptors* d;
      TF_RETURN_IF_ERROR(Descriptors(size, &d));
      TF_RETURN_IF_ERROR(
          Find(*d, cudnn_input, cudnn_output, workspace, workspace_limit, size, measurements));
    }
    if (layout_.form() == ConvForm::kDirect || measurements->size() == first) continue;
    // A call in another form costs its copies beside cuDNN's, and the copy of its input beside
    // cuDNN's workspace: both count against what the plan chooses.
    float copies_ms = 0;
    TF_RETURN_IF_ERROR(TimeFormCopies(size, cudnn_input, cudnn_output, &copies_ms));
    const size_t copy_bytes =
        size * ElementSize(type_) *
        (layout_.PaddedInputSampleSize() + (layout_.transposed() ? g_.OutputSampleSize() : 0));
    for (size_t i = first; i < measurements->size(); ++i) {
      AlgorithmMeasurement& m = (*measurements)[i];
      m.algorithm.form = layout_.form();
      m.time_ms += copies_ms;
      m.workspace += copy_bytes;
    }
  }
  return absl::OkStatus();
}

// The copies a micro-batch of `size` in the layout's form adds to cuDNN's call, as Run makes
// them: the input's strided samples, blocks or transposed copy gathered, or the input gradient
// (zeroed where the copy does not cover it) scattered back; and where cuDNN's tensors are
// transposed, the output's copy too (or the output gradient's).
absl::Status CudnnConvolution::TimeFormCopies(int64_t size, void* cudnn_input, void* cudnn_output,
                                              float* time_ms) {
  const absl::Status status = MedianGpuTime(
      stream_, kEngineTimingRepeats,
      [&] {
        absl::Status copied = kernel_ == ConvKernel::kBackpropInput
                                  ? CopyInputGradientBack(size, cudnn_input, buffers_.input)
                                  : Copy(layout_.InputCopy(size, /*to_cudnn=*/true),
                                         buffers_.input, cudnn_input);
        if (copied.ok() && layout_.transposed()) {
          copied = kernel_ == ConvKernel::kForward
                       ? Copy(layout_.OutputCopy(size, /*to_cudnn=*/false), cudnn_output,
                              buffers_.output)
                       : Copy(layout_.OutputCopy(size, /*to_cudnn=*/true), buffers_.output,
                              cudnn_output);
        }
        return copied;
      },
      time_ms);
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("timing the ", FormName(layout_.form()),
                                                  " copies of ",
                                                  KernelName(kernel_), " at ", size,
                                                  " samples: ", status.message()));
}

absl::Status CudnnConvolution::TimeEngines(void* cudnn_input, void* cudnn_output,
                                           void* workspace, size_t workspace_bytes, int64_t size,
                                           std::vector<AlgorithmMeasurement>* measurements) {
  std::vector<EngineTiming> timings;
  absl::Status status = TimeEngineConfigs(
      handle_.get(), Problem(size), static_cast<int64_t>(workspace_bytes), cudnn_input,
      cudnn_filter_, cudnn_output, workspace, kEngineTimingRepeats, &timings);
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("timing engine configurations of ",
                                                    KernelName(kernel_), " at ", size,
                                                    " samples for ", g_.DebugString(), ": ",
                                                    status.message()));
  }
  for (EngineTiming& timing : timings) {
    measurements->push_back({size, std::move(timing.config.spec), timing.time_ms,
                             static_cast<size_t>(timing.config.workspace_bytes),
                             timing.config.deterministic});
  }
  return absl::OkStatus();
}

absl::Status CudnnConvolution::Find(const SizeDescriptors& d, void* cudnn_input,
                                    void* cudnn_output, void* workspace, size_t workspace_bytes,
                                    int64_t size,
                                    std::vector<AlgorithmMeasurement>* measurements) {
  constexpr int kMaxResults = 32;
  int returned = 0;
  cudnnHandle_t h = handle_.get();
  const std::string what = absl::StrCat("cudnnFind ", KernelName(kernel_), " at ", size,
                                        " samples for ", g_.DebugString());
  // Keeps what a cudnnFind*AlgorithmEx call, made as the argument, timed.
  auto record = [&](cudnnStatus_t status, const auto* perf) -> absl::Status {
    TF_UCUDNN_RETURN_IF_CUDNN_ERROR(status, what);
    for (int i = 0; i < returned; ++i) {
      if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
      AlgorithmSpec algorithm;
      algorithm.automatic = false;
      algorithm.algo = static_cast<int>(perf[i].algo);
      algorithm.math = static_cast<MathMode>(perf[i].mathType);
      measurements->push_back({size, std::move(algorithm), perf[i].time, perf[i].memory,
                               perf[i].determinism == CUDNN_DETERMINISTIC});
    }
    return absl::OkStatus();
  };
  switch (kernel_) {
    case ConvKernel::kForward: {
      cudnnConvolutionFwdAlgoPerf_t perf[kMaxResults];
      return record(cudnnFindConvolutionForwardAlgorithmEx(
                        h, d.input.get(), cudnn_input, filter_desc_.get(), cudnn_filter_,
                        conv_desc_.get(), d.output.get(), cudnn_output, kMaxResults, &returned,
                        perf, workspace, workspace_bytes),
                    perf);
    }
    case ConvKernel::kBackpropInput: {
      cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxResults];
      return record(cudnnFindConvolutionBackwardDataAlgorithmEx(
                        h, filter_desc_.get(), cudnn_filter_, d.output.get(), cudnn_output,
                        conv_desc_.get(), d.input.get(), cudnn_input, kMaxResults, &returned,
                        perf, workspace, workspace_bytes),
                    perf);
    }
    case ConvKernel::kBackpropFilter: {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxResults];
      return record(cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        h, d.input.get(), cudnn_input, d.output.get(), cudnn_output,
                        conv_desc_.get(), filter_desc_.get(), cudnn_filter_, kMaxResults,
                        &returned, perf, workspace, workspace_bytes),
                    perf);
    }
  }
  return absl::OkStatus();
}

}  // namespace tf_ucudnn
