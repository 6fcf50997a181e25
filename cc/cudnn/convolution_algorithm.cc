// Which algorithm, math and workspace each micro-batch's cuDNN call runs with: the plan's own, or
// cuDNN's best heuristic choice within TensorFlow's workspace limit, remembered for the process.
#include "cc/cudnn/convolution.h"

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/cudnn/environment.h"
#include "cc/cudnn/types.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/util/determinism.h"

namespace tf_ucudnn {
namespace {

// Heuristic results may propose another math type than asked; take those that are no less exact.
bool MathAcceptable(cudnnMathType_t proposed, cudnnMathType_t asked, cudnnDataType_t type) {
  if (proposed == asked || proposed == CUDNN_FMA_MATH) return true;
  // Default math may use TF32 on float32 data, which only tensor-op math permits.
  return proposed == CUDNN_DEFAULT_MATH && (type != CUDNN_DATA_FLOAT || asked != CUDNN_FMA_MATH);
}

absl::Status ToStatus(cudnnStatus_t status) {
  return status == CUDNN_STATUS_SUCCESS ? absl::OkStatus() : FromCudnn(status, "cuDNN");
}

}  // namespace

struct CudnnConvolution::Candidate {
  int algo;
  cudnnMathType_t math;
  size_t memory;
};

// Resolving asks cuDNN for heuristics and workspace sizes, which in cuDNN 9 takes longer on the
// host than a small micro-batch takes on the GPU. The answer depends only on the key, so it is
// kept for the life of the process (failures are not kept: they end the step anyway).
absl::Status CudnnConvolution::CachedResolve(size_t index, ResolvedCall* call) {
  static std::mutex* mutex = new std::mutex;
  static auto* cache = new std::map<std::string, ResolvedCall>;
  const MicroBatch& mb = micro_batches_[index];
  const std::string key = absl::StrCat(
      device_, "|", KernelName(kernel_), "|", static_cast<int>(type_), "|", g_.channels_last, "|",
      g_.DebugString(), "|", mb.size, "|", mb.algorithm.ToString(), "|",
      static_cast<int>(TensorFlowMath(type_)), "|", tensorflow::OpDeterminismRequired(), "|",
      AutomaticWorkspaceLimit());
  {
    std::lock_guard<std::mutex> lock(*mutex);
    auto found = cache->find(key);
    if (found != cache->end()) {
      *call = found->second;
      return absl::OkStatus();
    }
  }
  TF_RETURN_IF_ERROR(Resolve(index, call));
  std::lock_guard<std::mutex> lock(*mutex);
  cache->emplace(key, *call);
  return absl::OkStatus();
}

// Picks the micro-batch's algorithm (given, or cuDNN's best that fits) and its workspace.
absl::Status CudnnConvolution::Resolve(size_t index, ResolvedCall* call) {
  const MicroBatch& mb = micro_batches_[index];
  SizeDescriptors* d;
  TF_RETURN_IF_ERROR(Descriptors(mb.size, &d));
  const bool deterministic = tensorflow::OpDeterminismRequired();
  const cudnnMathType_t tensorflow_math = TensorFlowMath(type_);
  if (mb.algorithm.is_engine()) {
    int64_t bytes = 0;
    absl::Status status = PrepareEngine(handle_.get(), Problem(mb.size), mb.algorithm, &bytes);
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat(Where(index), ": ", status.message(),
                                                      " for ", g_.DebugString()));
    }
    *call = {-1, tensorflow_math, static_cast<size_t>(bytes)};
    return absl::OkStatus();
  }
  if (mb.algorithm.automatic) {
    std::vector<Candidate> candidates;
    TF_RETURN_IF_ERROR(conv_desc_.SetMath(tensorflow_math));
    TF_RETURN_IF_ERROR(Heuristics(*d, &candidates));
    for (const Candidate& c : candidates) {
      if (!MathAcceptable(c.math, tensorflow_math, type_)) continue;
      if (deterministic && !IsDeterministic(kernel_, c.algo)) continue;
      if (c.memory > AutomaticWorkspaceLimit()) continue;
      TF_RETURN_IF_ERROR(conv_desc_.SetMath(c.math));
      size_t bytes = 0;
      if (!WorkspaceSize(*d, c.algo, &bytes).ok()) continue;
      *call = {c.algo, c.math, bytes};
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        Where(index), ": cuDNN proposes no algorithm for ", g_.DebugString(), " within ",
        AutomaticWorkspaceLimit() >> 20, " MiB of workspace (TF_CUDNN_WORKSPACE_LIMIT_IN_MB)",
        deterministic ? " that is deterministic" : ""));
  }
  const int algo = mb.algorithm.algo;
  if (deterministic && !IsDeterministic(kernel_, algo)) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(index), ": algorithm ", AlgorithmText(algo),
        " is not deterministic, but op determinism is enabled "
        "(tf.config.experimental.enable_op_determinism)"));
  }
  const cudnnMathType_t math = mb.algorithm.math == MathMode::kFromTensorFlow
                                   ? tensorflow_math
                                   : static_cast<cudnnMathType_t>(mb.algorithm.math);
  TF_RETURN_IF_ERROR(conv_desc_.SetMath(math));
  size_t bytes = 0;
  absl::Status status = WorkspaceSize(*d, algo, &bytes);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(Where(index), ": cuDNN does not support algorithm ",
                                     AlgorithmText(algo), " with ", MathName(math), " math for ",
                                     g_.DebugString(), " (", status.message(), ")"));
  }
  *call = {algo, math, bytes};
  return absl::OkStatus();
}

EngineProblem EngineProblemOf(ConvKernel kernel, const ConvGeometry& g, const CudnnLayout& layout,
                              cudnnDataType_t type, int64_t size, int device) {
  EngineProblem problem;
  problem.kernel = kernel;
  problem.type = type;
  problem.compute = ComputeType(type);
  problem.channels_last = layout.channels_last();
  problem.input_dims = layout.InputDims(size);
  problem.filter_dims = layout.FilterDims();
  problem.output_dims = layout.OutputDims(size);
  problem.padding = layout.symmetric_padding();
  problem.strides = layout.strides();
  problem.dilations.assign(g.dilations.begin(), g.dilations.end());
  problem.device = device;
  problem.deterministic_only = tensorflow::OpDeterminismRequired();
  problem.tensor_ops_allowed = type != CUDNN_DATA_FLOAT || TensorFlowMath(type) != CUDNN_FMA_MATH;
  return problem;
}

EngineProblem CudnnConvolution::Problem(int64_t size) const {
  return EngineProblemOf(kernel_, g_, layout_, type_, size, device_);
}

// cuDNN's heuristics, best first (the *_v7 queries need no buffers and run no kernels).
absl::Status CudnnConvolution::Heuristics(const SizeDescriptors& d,
                                          std::vector<Candidate>* candidates) {
  constexpr int kMaxResults = 16;
  int returned = 0;
  cudnnHandle_t h = handle_.get();
  candidates->clear();
  // Keeps what a cudnnGet*Algorithm_v7 call, made as the argument, proposed.
  auto keep = [&](cudnnStatus_t status, const char* what, const auto* perf) -> absl::Status {
    TF_UCUDNN_RETURN_IF_CUDNN_ERROR(status, what);
    for (int i = 0; i < returned; ++i) {
      if (perf[i].status == CUDNN_STATUS_SUCCESS) {
        candidates->push_back({perf[i].algo, perf[i].mathType, perf[i].memory});
      }
    }
    return absl::OkStatus();
  };
  switch (kernel_) {
    case ConvKernel::kForward: {
      cudnnConvolutionFwdAlgoPerf_t perf[kMaxResults];
      return keep(cudnnGetConvolutionForwardAlgorithm_v7(h, d.input.get(), filter_desc_.get(),
                                                         conv_desc_.get(), d.output.get(),
                                                         kMaxResults, &returned, perf),
                  "cudnnGetConvolutionForwardAlgorithm_v7", perf);
    }
    case ConvKernel::kBackpropInput: {
      cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxResults];
      return keep(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, filter_desc_.get(),
                                                              d.output.get(), conv_desc_.get(),
                                                              d.input.get(), kMaxResults,
                                                              &returned, perf),
                  "cudnnGetConvolutionBackwardDataAlgorithm_v7", perf);
    }
    case ConvKernel::kBackpropFilter: {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxResults];
      return keep(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.input.get(), d.output.get(),
                                                                conv_desc_.get(),
                                                                filter_desc_.get(), kMaxResults,
                                                                &returned, perf),
                  "cudnnGetConvolutionBackwardFilterAlgorithm_v7", perf);
    }
  }
  return absl::OkStatus();
}

absl::Status CudnnConvolution::WorkspaceSize(const SizeDescriptors& d, int algo, size_t* bytes) {
  cudnnHandle_t h = handle_.get();
  switch (kernel_) {
    case ConvKernel::kForward:
      return ToStatus(cudnnGetConvolutionForwardWorkspaceSize(
          h, d.input.get(), filter_desc_.get(), conv_desc_.get(), d.output.get(),
          static_cast<cudnnConvolutionFwdAlgo_t>(algo), bytes));
    case ConvKernel::kBackpropInput:
      return ToStatus(cudnnGetConvolutionBackwardDataWorkspaceSize(
          h, filter_desc_.get(), d.output.get(), conv_desc_.get(), d.input.get(),
          static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), bytes));
    case ConvKernel::kBackpropFilter:
      return ToStatus(cudnnGetConvolutionBackwardFilterWorkspaceSize(
          h, d.input.get(), d.output.get(), conv_desc_.get(), filter_desc_.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), bytes));
  }
  return absl::InternalError("unknown kernel");
}

}  // namespace tf_ucudnn
