// Engine configurations through cudnn-frontend's graph API (see engines.h). One graph is built
// per problem and configuration and kept for the process, with its execution plan: building a
// plan takes milliseconds of host time, far more than a small micro-batch takes on the GPU.
#include "cc/cudnn/engines.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/cudnn/cudnn_support.h"
#include "cc/cudnn/environment.h"
#include "cc/cudnn/knob_variants.h"
#include "tensorflow/core/platform/errors.h"

#if TF_UCUDNN_CUDNN_FRONTEND
// TensorFlow's framework library exports the symbols of its own, older cudnn-frontend and of the
// JSON library the frontend bundles. Under their usual names, the dynamic linker binds this
// library's calls of the frontend's inline functions to TensorFlow's copies, whose classes have
// another layout (seen as a crash in Graph::tensor); renamed, this build's copies are its own.
#define cudnn_frontend tf_ucudnn_cudnn_frontend
#define nlohmann tf_ucudnn_nlohmann
#include <cudnn_frontend.h>
#endif

namespace tf_ucudnn {

std::string EngineProblem::Key() const {
  return absl::StrCat(device, "|", KernelName(kernel), "|", static_cast<int>(type), "|",
                      static_cast<int>(compute), "|", channels_last, "|",
                      absl::StrJoin(input_dims, ","), "|", absl::StrJoin(filter_dims, ","), "|",
                      absl::StrJoin(output_dims, ","), "|", absl::StrJoin(padding, ","), "|",
                      absl::StrJoin(strides, ","), "|", absl::StrJoin(dilations, ","), "|",
                      deterministic_only, "|", tensor_ops_allowed);
}

#if TF_UCUDNN_CUDNN_FRONTEND

namespace {

namespace fe = cudnn_frontend;

// Tensor uids in the variant pack.
constexpr int64_t kInputUid = 1;
constexpr int64_t kFilterUid = 2;
constexpr int64_t kOutputUid = 3;

// KnobType_t by the names plans use (cudnnBackendKnobType_t's, without CUDNN_KNOB_TYPE_).
const std::map<std::string, fe::KnobType_t>& KnobTypes() {
  static const auto* types = new std::map<std::string, fe::KnobType_t>{
      {"SWIZZLE", fe::KnobType_t::SWIZZLE},
      {"TILE_SIZE", fe::KnobType_t::TILE_SIZE},
      {"EDGE", fe::KnobType_t::EDGE},
      {"MULTIPLY", fe::KnobType_t::MULTIPLY},
      {"SPLIT_K_BUF", fe::KnobType_t::SPLIT_K_BUF},
      {"TILEK", fe::KnobType_t::TILEK},
      {"STAGES", fe::KnobType_t::STAGES},
      {"REDUCTION_MODE", fe::KnobType_t::REDUCTION_MODE},
      {"SPLIT_K_SLC", fe::KnobType_t::SPLIT_K_SLC},
      {"IDX_MODE", fe::KnobType_t::IDX_MODE},
      {"SPECFILT", fe::KnobType_t::SPECFILT},
      {"KERNEL_CFG", fe::KnobType_t::KERNEL_CFG},
      {"WORKSPACE", fe::KnobType_t::WORKSPACE},
      {"TILE_CGA_M", fe::KnobType_t::TILE_CGA_M},
      {"TILE_CGA_N", fe::KnobType_t::TILE_CGA_N},
      {"BLOCK_SIZE", fe::KnobType_t::BLOCK_SIZE},
      {"OCCUPANCY", fe::KnobType_t::OCCUPANCY},
      {"ARRAY_SIZE_PER_THREAD", fe::KnobType_t::ARRAY_SIZE_PER_THREAD},
      {"SPLIT_COLS", fe::KnobType_t::SPLIT_COLS},
      {"TILE_ROWS", fe::KnobType_t::TILE_ROWS},
      {"TILE_COLS", fe::KnobType_t::TILE_COLS},
      {"LOAD_SIZE", fe::KnobType_t::LOAD_SIZE},
      {"CTA_COUNT", fe::KnobType_t::CTA_COUNT},
      {"STREAM_K", fe::KnobType_t::STREAM_K},
      {"SPLIT_P_SLC", fe::KnobType_t::SPLIT_P_SLC},
      {"TILE_M", fe::KnobType_t::TILE_M},
      {"TILE_N", fe::KnobType_t::TILE_N},
      {"WARP_SPEC_CFG", fe::KnobType_t::WARP_SPEC_CFG},
      {"SWAP_AB", fe::KnobType_t::SWAP_AB},
      {"INPUT_TMA_ENABLE", fe::KnobType_t::INPUT_TMA_ENABLE},
      {"OUTPUT_TMA_ENABLE", fe::KnobType_t::OUTPUT_TMA_ENABLE},
      {"TILE_CGA", fe::KnobType_t::TILE_CGA},
  };
  return *types;
}

absl::Status FromFrontend(fe::error_t error, absl::string_view what) {
  if (error.is_good()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", error.get_message()));
}

#define TF_UCUDNN_RETURN_IF_FE_ERROR(expr, what)                      \
  do {                                                                \
    absl::Status fe_status_ = FromFrontend((expr), (what));           \
    if (!fe_status_.ok()) return fe_status_;                          \
  } while (0)

absl::Status ToFrontendType(cudnnDataType_t type, fe::DataType_t* out) {
  switch (type) {
    case CUDNN_DATA_FLOAT:
      *out = fe::DataType_t::FLOAT;
      return absl::OkStatus();
    case CUDNN_DATA_DOUBLE:
      *out = fe::DataType_t::DOUBLE;
      return absl::OkStatus();
    case CUDNN_DATA_HALF:
      *out = fe::DataType_t::HALF;
      return absl::OkStatus();
    case CUDNN_DATA_BFLOAT16:
      *out = fe::DataType_t::BFLOAT16;
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("no cuDNN graph-API data type for ", static_cast<int>(type)));
  }
}

// Packed strides of `dims` ([N, C, spatial...]) in the layout the tensors have in memory.
std::vector<int64_t> PackedStrides(const std::vector<int64_t>& dims, bool channels_last) {
  std::vector<int64_t> order;  // dims from the innermost out
  if (channels_last) {
    order.push_back(1);
    for (size_t d = dims.size() - 1; d >= 2; --d) order.push_back(d);
    order.push_back(0);
  } else {
    for (size_t d = dims.size(); d-- > 0;) order.push_back(d);
  }
  std::vector<int64_t> strides(dims.size());
  int64_t stride = 1;
  for (int64_t d : order) {
    strides[d] = stride;
    stride *= dims[d];
  }
  return strides;
}

// A graph of the problem's one convolution, its operation graph built.
absl::Status BuildGraph(cudnnHandle_t handle, const EngineProblem& p,
                        std::shared_ptr<fe::graph::Graph>* out) {
  fe::DataType_t io_type, compute_type;
  TF_RETURN_IF_ERROR(ToFrontendType(p.type, &io_type));
  TF_RETURN_IF_ERROR(ToFrontendType(p.compute, &compute_type));
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(io_type).set_compute_data_type(compute_type);
  const auto tensor = [&](const char* name, int64_t uid, const std::vector<int64_t>& dims) {
    return fe::graph::Tensor_attributes()
        .set_name(name)
        .set_uid(uid)
        .set_dim(dims)
        .set_stride(PackedStrides(dims, p.channels_last));
  };
  std::shared_ptr<fe::graph::Tensor_attributes> result;
  switch (p.kernel) {
    case ConvKernel::kForward: {
      auto x = graph->tensor(tensor("x", kInputUid, p.input_dims));
      auto w = graph->tensor(tensor("w", kFilterUid, p.filter_dims));
      result = graph->conv_fprop(x, w,
                                 fe::graph::Conv_fprop_attributes()
                                     .set_padding(p.padding)
                                     .set_stride(p.strides)
                                     .set_dilation(p.dilations));
      result->set_uid(kOutputUid).set_dim(p.output_dims);
      result->set_stride(PackedStrides(p.output_dims, p.channels_last));
      break;
    }
    case ConvKernel::kBackpropInput: {
      auto dy = graph->tensor(tensor("dy", kOutputUid, p.output_dims));
      auto w = graph->tensor(tensor("w", kFilterUid, p.filter_dims));
      result = graph->conv_dgrad(dy, w,
                                 fe::graph::Conv_dgrad_attributes()
                                     .set_padding(p.padding)
                                     .set_stride(p.strides)
                                     .set_dilation(p.dilations));
      result->set_uid(kInputUid).set_dim(p.input_dims);
      result->set_stride(PackedStrides(p.input_dims, p.channels_last));
      break;
    }
    case ConvKernel::kBackpropFilter: {
      auto dy = graph->tensor(tensor("dy", kOutputUid, p.output_dims));
      auto x = graph->tensor(tensor("x", kInputUid, p.input_dims));
      result = graph->conv_wgrad(dy, x,
                                 fe::graph::Conv_wgrad_attributes()
                                     .set_padding(p.padding)
                                     .set_stride(p.strides)
                                     .set_dilation(p.dilations));
      result->set_uid(kFilterUid).set_dim(p.filter_dims);
      result->set_stride(PackedStrides(p.filter_dims, p.channels_last));
      break;
    }
  }
  result->set_output(true);
  TF_UCUDNN_RETURN_IF_FE_ERROR(graph->validate(), "cudnn-frontend graph validation");
  TF_UCUDNN_RETURN_IF_FE_ERROR(graph->build_operation_graph(handle),
                               "cudnn-frontend operation graph");
  *out = std::move(graph);
  return absl::OkStatus();
}

absl::Status ToKnobs(const AlgorithmSpec& spec,
                     std::unordered_map<fe::KnobType_t, int64_t>* knobs) {
  for (const auto& [name, value] : spec.knobs) {
    auto found = KnobTypes().find(name);
    if (found == KnobTypes().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", spec.ToString(), "': knob ", name, " is not one this build knows"));
    }
    (*knobs)[found->second] = value;
  }
  return absl::OkStatus();
}

std::string KnobName(fe::KnobType_t type) {
  for (const auto& [name, known] : KnobTypes()) {
    if (known == type) return name;
  }
  return absl::StrCat("KNOB_", static_cast<int64_t>(type));  // newer than this build's table
}

// The knobs whose values the listing varies (knob_variants.h says why).
bool TradesWorkspace(fe::KnobType_t type) {
  switch (type) {
    case fe::KnobType_t::WORKSPACE:
    case fe::KnobType_t::SPLIT_K_BUF:
    case fe::KnobType_t::SPLIT_K_SLC:
    case fe::KnobType_t::REDUCTION_MODE:
    case fe::KnobType_t::STREAM_K:
    case fe::KnobType_t::SPLIT_P_SLC:
      return true;
    default:
      return false;
  }
}

// Adds to the graph's candidates the knob variants KnobVariants chooses from the heuristics'
// configurations and cuDNN's knob ranges. A variant cuDNN rejects is not added; check_support and
// the workspace limit then treat the variants as they do the heuristics' configurations.
void AddKnobVariants(fe::graph::Graph& graph) {
  std::set<std::string> known;
  std::set<int64_t> engines_seen;
  std::vector<EngineKnobs> engines;
  const int64_t offered = graph.get_execution_plan_count();
  for (int64_t i = 0; i < offered; ++i) {
    int64_t engine = 0;
    std::unordered_map<fe::KnobType_t, int64_t> knobs;
    if (!graph.get_engine_and_knobs_at_index(i, engine, knobs).is_good()) continue;
    KnobMap choices;
    for (const auto& [type, value] : knobs) {
      // A knob this frontend cannot name keeps its default.
      if (type != fe::KnobType_t::NOT_SET) choices[static_cast<int64_t>(type)] = value;
    }
    known.insert(KnobVariantKey(engine, choices));
    if (!engines_seen.insert(engine).second) continue;
    std::vector<fe::Knob> ranges;
    if (!graph.get_knobs_for_engine(engine, ranges).is_good()) continue;
    EngineKnobs& entry = engines.emplace_back();
    entry.engine = engine;
    entry.first = std::move(choices);
    for (const fe::Knob& range : ranges) {
      if (!TradesWorkspace(range.type)) continue;
      entry.ranges.push_back(
          {static_cast<int64_t>(range.type), range.minValue, range.maxValue, range.stride});
    }
  }
  for (const KnobVariant& variant : KnobVariants(engines, std::move(known))) {
    std::unordered_map<fe::KnobType_t, int64_t> knobs;
    for (const auto& [type, value] : variant.knobs) {
      knobs[static_cast<fe::KnobType_t>(type)] = value;
    }
    (void)graph.create_execution_plan(variant.engine, knobs);
  }
}

// A configuration's graph with its one execution plan built.
struct PreparedEngine {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

}  // namespace

bool EnginesAvailable() { return true; }

absl::Status ListEngineConfigs(cudnnHandle_t handle, const EngineProblem& problem,
                               int64_t workspace_limit, std::vector<EngineConfigInfo>* configs) {
  configs->clear();
  std::shared_ptr<fe::graph::Graph> graph;
  TF_RETURN_IF_ERROR(BuildGraph(handle, problem, &graph));
  TF_UCUDNN_RETURN_IF_FE_ERROR(
      graph->create_execution_plans(
          {fe::HeurMode_t::A, fe::HeurMode_t::B, fe::HeurMode_t::FALLBACK}),
      "cuDNN heuristics");
  AddKnobVariants(*graph);
  graph->deselect_workspace_greater_than(workspace_limit);
  if (!RuntimeCompiledEngines()) {
    graph->deselect_behavior_notes({fe::BehaviorNote_t::RUNTIME_COMPILATION});
  }
  if (problem.deterministic_only) {
    graph->deselect_numeric_notes({fe::NumericalNote_t::NONDETERMINISTIC});
  }
  if (!problem.tensor_ops_allowed) {
    graph->deselect_numeric_notes({fe::NumericalNote_t::TENSOR_CORE});
  }
  // Some configurations fail their support check; those are left out, not an error.
  (void)graph->check_support(handle);
  // The modes may offer the same configuration, and a knob cuDNN ignores
  // leaves a variant the same as another.
  std::set<std::string> seen;
  std::vector<int64_t> listed;  // each listed configuration's plan index
  for (int64_t i = 0; i < graph->get_execution_plan_count(); ++i) {
    int64_t workspace = 0;
    if (!graph->build_plan_at_index(handle, i).is_good()) continue;
    if (!graph->get_workspace_size_plan_at_index(i, workspace).is_good()) continue;
    if (workspace > workspace_limit) continue;
    EngineConfigInfo info;
    std::unordered_map<fe::KnobType_t, int64_t> knobs;
    TF_UCUDNN_RETURN_IF_FE_ERROR(graph->get_engine_and_knobs_at_index(i, info.spec.engine, knobs),
                                 "engine knobs");
    info.spec.automatic = false;
    for (const auto& [type, value] : knobs) {
      // A knob of a type this frontend does not know reads as NOT_SET, and cannot be set again.
      if (type == fe::KnobType_t::NOT_SET) continue;
      info.spec.knobs.emplace_back(KnobName(type), value);
    }
    std::sort(info.spec.knobs.begin(), info.spec.knobs.end());
    info.workspace_bytes = workspace;
    if (seen.insert(info.spec.ToString()).second) {
      configs->push_back(std::move(info));
      listed.push_back(i);
    }
  }
  // Which are deterministic: deselecting cuDNN's NONDETERMINISTIC note bars the configurations
  // that carry it, and a barred one no longer builds (a built one is not built again).
  if (!problem.deterministic_only) {
    graph->deselect_numeric_notes({fe::NumericalNote_t::NONDETERMINISTIC});
  }
  for (size_t c = 0; c < configs->size(); ++c) {
    (*configs)[c].deterministic = graph->build_plan_at_index(handle, listed[c]).is_good();
  }
  return absl::OkStatus();
}

namespace {

// Builds `spec`'s plan for `problem`, or returns the one built before.
absl::Status CachedEngine(cudnnHandle_t handle, const EngineProblem& problem,
                          const AlgorithmSpec& spec, const PreparedEngine** prepared) {
  static std::mutex* mutex = new std::mutex;
  static auto* cache = new std::map<std::string, std::unique_ptr<PreparedEngine>>;
  const std::string key = absl::StrCat(problem.Key(), "|", spec.ToString());
  {
    std::lock_guard<std::mutex> lock(*mutex);
    auto found = cache->find(key);
    if (found != cache->end()) {
      *prepared = found->second.get();
      return absl::OkStatus();
    }
  }
  auto engine = std::make_unique<PreparedEngine>();
  TF_RETURN_IF_ERROR(BuildGraph(handle, problem, &engine->graph));
  std::unordered_map<fe::KnobType_t, int64_t> knobs;
  TF_RETURN_IF_ERROR(ToKnobs(spec, &knobs));
  const std::string what = absl::StrCat("cuDNN engine configuration '", spec.ToString(), "'");
  TF_UCUDNN_RETURN_IF_FE_ERROR(engine->graph->create_execution_plan(spec.engine, knobs), what);
  // A nondeterministic configuration then fails the support check below.
  if (problem.deterministic_only) {
    engine->graph->deselect_numeric_notes({fe::NumericalNote_t::NONDETERMINISTIC});
  }
  TF_UCUDNN_RETURN_IF_FE_ERROR(engine->graph->check_support(handle), what);
  TF_UCUDNN_RETURN_IF_FE_ERROR(engine->graph->build_plans(handle, fe::BuildPlanPolicy_t::ALL),
                               what);
  TF_UCUDNN_RETURN_IF_FE_ERROR(engine->graph->get_workspace_size(engine->workspace_bytes), what);
  std::lock_guard<std::mutex> lock(*mutex);
  auto& slot = (*cache)[key];
  if (slot == nullptr) slot = std::move(engine);
  *prepared = slot.get();
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareEngine(cudnnHandle_t handle, const EngineProblem& problem,
                           const AlgorithmSpec& spec, int64_t* workspace_bytes) {
  const PreparedEngine* prepared = nullptr;
  TF_RETURN_IF_ERROR(CachedEngine(handle, problem, spec, &prepared));
  *workspace_bytes = prepared->workspace_bytes;
  return absl::OkStatus();
}

absl::Status ExecuteEngine(cudnnHandle_t handle, const EngineProblem& problem,
                           const AlgorithmSpec& spec, void* input, void* filter, void* output,
                           void* workspace) {
  const PreparedEngine* prepared = nullptr;
  TF_RETURN_IF_ERROR(CachedEngine(handle, problem, spec, &prepared));
  std::unordered_map<int64_t, void*> pointers = {
      {kInputUid, input}, {kFilterUid, filter}, {kOutputUid, output}};
  return FromFrontend(prepared->graph->execute(handle, pointers, workspace),
                      absl::StrCat("cuDNN engine configuration '", spec.ToString(), "'"));
}

absl::Status TimeEngineConfigs(cudnnHandle_t handle, const EngineProblem& problem,
                               int64_t workspace_limit, void* input, void* filter, void* output,
                               void* workspace, int repeats, std::vector<EngineTiming>* timings) {
  timings->clear();
  std::vector<EngineConfigInfo> configs;
  TF_RETURN_IF_ERROR(ListEngineConfigs(handle, problem, workspace_limit, &configs));
  cudaStream_t stream = nullptr;
  TF_UCUDNN_RETURN_IF_CUDNN_ERROR(cudnnGetStream(handle, &stream), "cudnnGetStream");
  for (EngineConfigInfo& info : configs) {
    // Timed as a plan will run it: rebuilt from its engine and knobs alone, which need not be
    // the configuration the heuristics built (a knob the frontend cannot name takes its default).
    int64_t workspace_bytes = 0;
    if (!PrepareEngine(handle, problem, info.spec, &workspace_bytes).ok() ||
        workspace_bytes > workspace_limit) {
      continue;
    }
    float time_ms = 0;
    // A configuration that cannot run is no candidate.
    if (!MedianGpuTime(stream, repeats, [&] {
           return ExecuteEngine(handle, problem, info.spec, input, filter, output, workspace);
         }, &time_ms).ok()) {
      continue;
    }
    info.workspace_bytes = workspace_bytes;
    timings->push_back({std::move(info), time_ms});
  }
  // A kernel that failed asynchronously would poison the next op; say so here instead.
  TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream),
                                 "timing cuDNN engine configurations");
  return absl::OkStatus();
}

#else  // !TF_UCUDNN_CUDNN_FRONTEND

namespace {

absl::Status NoFrontend() {
  return absl::UnimplementedError(
      "tf_ucudnn was built without cudnn-frontend's headers, so it cannot run cuDNN engine "
      "configurations; rebuild with the nvidia-cudnn-frontend package installed (pip install "
      "'tf_ucudnn[gpu]') or CUDNN_FRONTEND_INCLUDE naming its include directory");
}

}  // namespace

bool EnginesAvailable() { return false; }

absl::Status ListEngineConfigs(cudnnHandle_t, const EngineProblem&, int64_t,
                               std::vector<EngineConfigInfo>*) {
  return NoFrontend();
}

absl::Status PrepareEngine(cudnnHandle_t, const EngineProblem&, const AlgorithmSpec&, int64_t*) {
  return NoFrontend();
}

absl::Status ExecuteEngine(cudnnHandle_t, const EngineProblem&, const AlgorithmSpec&, void*,
                           void*, void*, void*) {
  return NoFrontend();
}

absl::Status TimeEngineConfigs(cudnnHandle_t, const EngineProblem&, int64_t, void*, void*, void*,
                               void*, int, std::vector<EngineTiming>*) {
  return NoFrontend();
}

#endif  // TF_UCUDNN_CUDNN_FRONTEND

}  // namespace tf_ucudnn
