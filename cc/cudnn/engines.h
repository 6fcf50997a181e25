// cuDNN's graph-API engines for one convolution kernel, through NVIDIA's header-only
// cudnn-frontend: the engine configurations cuDNN offers (engine, knobs, workspace), and running
// one of them. Compiled with TF_UCUDNN_CUDNN_FRONTEND=1 where setup.py finds the frontend's
// headers; without them every function here returns kUnimplemented saying so, and plans with
// engine configurations fail when they run on a GPU (the legacy algorithms work as before).
#ifndef TF_UCUDNN_CC_CUDNN_ENGINES_H_
#define TF_UCUDNN_CC_CUDNN_ENGINES_H_

#include <cstdint>
#include <string>
#include <vector>

#include <cudnn.h>

#include "absl/status/status.h"
#include "cc/common/conv_geometry.h"
#include "cc/common/micro_batch_plan.h"

namespace tf_ucudnn {

// One kernel at one micro-batch size as cuDNN's graph sees it: packed tensors in cuDNN's logical
// dim order ([N, C, spatial...], filters [K, C / groups, spatial...]), symmetric padding.
struct EngineProblem {
  ConvKernel kernel = ConvKernel::kForward;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  bool channels_last = false;
  std::vector<int64_t> input_dims, filter_dims, output_dims;
  std::vector<int64_t> padding, strides, dilations;
  int device = 0;
  bool deterministic_only = false;  // TensorFlow's op determinism: leave out the others
  // Whether tensor-core math may stand in for float32 (TensorFlow's TF32 setting): where not,
  // listings leave out configurations with cuDNN's TENSOR_CORE numerical note, as TensorFlow does.
  bool tensor_ops_allowed = true;

  // Everything the graph depends on: plans are cached under it.
  std::string Key() const;
};

// One engine configuration cuDNN offers for a problem.
struct EngineConfigInfo {
  AlgorithmSpec spec;  // engine and knobs
  int64_t workspace_bytes = 0;
  bool deterministic = false;  // without cuDNN's NONDETERMINISTIC numerical note
};

// One engine configuration's run time, from TimeEngineConfigs.
struct EngineTiming {
  EngineConfigInfo config;
  float time_ms = 0;
};

// Whether this build can use engines (the frontend's headers were found).
bool EnginesAvailable();

// The engine configurations of heuristics modes A, B and FALLBACK (a mode cuDNN cannot answer for
// the problem adds none; the frontend queries each apart), and those one workspace-trading
// knob (WORKSPACE, split-K's, REDUCTION_MODE, STREAM_K, SPLIT_P_SLC) away from each engine's
// first, through the values cuDNN gives the knob's range, deduplicated, that need at most
// `workspace_limit` bytes (cudnn-frontend's deselect_workspace_greater_than) and cuDNN supports.
// Configurations that compile their kernels at run time (nvrtc) are left out unless
// TF_UCUDNN_RUNTIME_COMPILED_ENGINES=1 (environment.h): building one takes seconds, paid again by
// every process for every micro-batch size.
absl::Status ListEngineConfigs(cudnnHandle_t handle, const EngineProblem& problem,
                               int64_t workspace_limit, std::vector<EngineConfigInfo>* configs);

// Runs each configuration ListEngineConfigs gives on the handle's stream, on the problem's
// tensors (`input`, `filter`, `output` as ExecuteEngine takes them; the kernel's result is
// overwritten) with `workspace` of `workspace_limit` bytes, and times it: one warm-up run, then
// the median of `repeats` runs, each between two CUDA events. Each runs as PrepareEngine builds
// it from its engine and knobs, as a plan naming it will run (the heuristics' own build of it
// may be another configuration), with that build's workspace. A configuration that fails to
// build or run, or whose build needs more than the limit, is left out.
absl::Status TimeEngineConfigs(cudnnHandle_t handle, const EngineProblem& problem,
                               int64_t workspace_limit, void* input, void* filter, void* output,
                               void* workspace, int repeats, std::vector<EngineTiming>* timings);

// Builds (once per problem and configuration, for the process) the execution plan of `spec` and
// gives its workspace. A configuration cuDNN does not support for the problem is an error.
absl::Status PrepareEngine(cudnnHandle_t handle, const EngineProblem& problem,
                           const AlgorithmSpec& spec, int64_t* workspace_bytes);

// Runs the prepared plan on the handle's stream: y = conv(x, w) for the forward kernel, dx for
// backprop input, dw for backprop filter (each overwritten). `workspace` holds the plan's bytes.
absl::Status ExecuteEngine(cudnnHandle_t handle, const EngineProblem& problem,
                           const AlgorithmSpec& spec, void* input, void* filter, void* output,
                           void* workspace);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_ENGINES_H_
