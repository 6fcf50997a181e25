// Which of cuDNN's fusions of a convolution with batch normalization's work run in fp32, and at
// what cost against the convolution alone, for ResNet-50's layer shapes (batch 128, NHWC).
//
// The graphs: the convolution alone; with its output's per-channel sum and sum of squares
// (genstats, batch normalization's statistics); with the previous layer's normalization and ReLU
// applied to its input (a scale, bias and ReLU prologue); both; the data gradient with the ReLU's
// gradient; the filter gradient with the prologue. Every engine configuration cuDNN lists
// (heuristics A and fallback, runtime-compiled ones included) is built and timed; a line of JSON
// per graph gives the count of configurations, how many built and the fastest one's time.
//
// Built by benchmarks/cudnn_fusion_probe.sh; it needs a GPU and cuDNN 9.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

namespace fe = cudnn_frontend;

namespace {

struct Layer {
  const char* name;
  int64_t n, c, h, w, k, r, stride, pad;
  int64_t out_h() const { return (h + 2 * pad - r) / stride + 1; }
  int64_t out_w() const { return (w + 2 * pad - r) / stride + 1; }
};

enum class Variant { kConv, kConvStats, kPrologueConv, kPrologueConvStats, kDgradDrelu,
                     kDgrad, kWgrad, kPrologueWgrad };

const char* VariantName(Variant v) {
  switch (v) {
    case Variant::kConv: return "conv";
    case Variant::kConvStats: return "conv+genstats";
    case Variant::kPrologueConv: return "scale_bias_relu+conv";
    case Variant::kPrologueConvStats: return "scale_bias_relu+conv+genstats";
    case Variant::kDgrad: return "dgrad";
    case Variant::kDgradDrelu: return "dgrad+relu_bwd";
    case Variant::kWgrad: return "wgrad";
    case Variant::kPrologueWgrad: return "scale_bias_relu+wgrad";
  }
  return "?";
}

// NHWC strides for NCHW-ordered dims, as cuDNN's graph API takes them.
std::vector<int64_t> ChannelsLast(const std::vector<int64_t>& d) {
  return {d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]};
}

enum Uid : int64_t { kX = 1, kW, kY, kSum, kSqSum, kScale, kBias, kDy, kDx, kAct, kDw };

std::shared_ptr<fe::graph::Tensor_attributes> Tensor(fe::graph::Graph& g, const char* name,
                                                     int64_t uid, std::vector<int64_t> dims) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims)
                      .set_stride(ChannelsLast(dims)));
}

// relu(x * scale + bias), the scale and bias per channel.
std::shared_ptr<fe::graph::Tensor_attributes> Prologue(
    fe::graph::Graph& g, std::shared_ptr<fe::graph::Tensor_attributes> x, int64_t channels) {
  auto scale = Tensor(g, "scale", kScale, {1, channels, 1, 1});
  auto bias = Tensor(g, "bias", kBias, {1, channels, 1, 1});
  auto scaled = g.pointwise(x, scale, fe::graph::Pointwise_attributes().set_mode(
                                          fe::PointwiseMode_t::MUL));
  auto shifted = g.pointwise(scaled, bias, fe::graph::Pointwise_attributes().set_mode(
                                               fe::PointwiseMode_t::ADD));
  return g.pointwise(shifted,
                     fe::graph::Pointwise_attributes().set_mode(fe::PointwiseMode_t::RELU_FWD));
}

// A message as a JSON string's contents.
std::string Escaped(std::string s) {
  for (char& ch : s) {
    if (ch == '"' || ch == '\\') ch = '\'';
    if (ch == '\n') ch = ' ';
  }
  return s;
}

// The layer's padding, strides and dilations, for any of the three convolution nodes.
template <typename Attributes>
Attributes Geometry(const Layer& l) {
  return Attributes().set_padding({l.pad, l.pad}).set_stride({l.stride, l.stride})
      .set_dilation({1, 1});
}

std::shared_ptr<fe::graph::Graph> Build(const Layer& l, Variant v) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::FLOAT)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::vector<int64_t> xd = {l.n, l.c, l.h, l.w}, wd = {l.k, l.c, l.r, l.r},
                             yd = {l.n, l.k, l.out_h(), l.out_w()};
  const bool prologue = v == Variant::kPrologueConv || v == Variant::kPrologueConvStats ||
                        v == Variant::kPrologueWgrad;
  const auto input = [&] {  // the convolution's input, normalized and activated or not
    auto x = Tensor(*g, "x", kX, xd);
    return prologue ? Prologue(*g, x, l.c) : x;
  };
  switch (v) {
    case Variant::kConv:
    case Variant::kConvStats:
    case Variant::kPrologueConv:
    case Variant::kPrologueConvStats: {
      auto y = g->conv_fprop(input(), Tensor(*g, "w", kW, wd),
                             Geometry<fe::graph::Conv_fprop_attributes>(l));
      y->set_uid(kY).set_dim(yd).set_stride(ChannelsLast(yd)).set_output(true);
      if (v == Variant::kConvStats || v == Variant::kPrologueConvStats) {
        auto [sum, sq_sum] = g->genstats(y, fe::graph::Genstats_attributes());
        sum->set_uid(kSum).set_output(true).set_data_type(fe::DataType_t::FLOAT);
        sq_sum->set_uid(kSqSum).set_output(true).set_data_type(fe::DataType_t::FLOAT);
      }
      break;
    }
    case Variant::kDgrad:
    case Variant::kDgradDrelu: {
      auto dy = Tensor(*g, "dy", kDy, yd);
      auto w = Tensor(*g, "w", kW, wd);
      auto dx = g->conv_dgrad(dy, w, Geometry<fe::graph::Conv_dgrad_attributes>(l));
      dx->set_dim(xd).set_stride(ChannelsLast(xd));
      if (v == Variant::kDgradDrelu) {
        auto act = Tensor(*g, "act", kAct, xd);
        dx = g->pointwise(dx, act, fe::graph::Pointwise_attributes().set_mode(
                                       fe::PointwiseMode_t::RELU_BWD));
        dx->set_dim(xd).set_stride(ChannelsLast(xd));
      }
      dx->set_uid(kDx).set_output(true);
      break;
    }
    case Variant::kWgrad:
    case Variant::kPrologueWgrad: {
      auto dw = g->conv_wgrad(Tensor(*g, "dy", kDy, yd), input(),
                              Geometry<fe::graph::Conv_wgrad_attributes>(l));
      dw->set_uid(kDw).set_dim(wd).set_stride(ChannelsLast(wd)).set_output(true);
      break;
    }
  }
  return g;
}

#define CUDA_CHECK(x)                                                              \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e));                 \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

struct Buffers {
  std::unordered_map<int64_t, void*> by_uid;
  ~Buffers() {
    for (auto& [uid, p] : by_uid) cudaFree(p);
  }
  void* Get(int64_t uid, size_t bytes, float fill) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    std::vector<float> host(bytes / 4);
    for (size_t i = 0; i < host.size(); ++i) {
      host[i] = fill * ((i * 2654435761u % 1000) / 1000.f - 0.3f);
    }
    CUDA_CHECK(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice));
    by_uid[uid] = p;
    return p;
  }
};

void Probe(cudnnHandle_t handle, const Layer& l, Variant v, int64_t max_plans, int repeats) {
  const std::string head = std::string("{\"layer\": \"") + l.name + "\", \"graph\": \"" +
                           VariantName(v) + "\"";
  auto g = Build(l, v);
  auto status = g->validate();
  if (status.is_good()) status = g->build_operation_graph(handle);
  if (status.is_good()) status = g->create_execution_plans({fe::HeurMode_t::A,
                                                             fe::HeurMode_t::FALLBACK});
  if (!status.is_good()) {
    std::printf("%s, \"error\": \"%s\"}\n", head.c_str(), Escaped(status.get_message()).c_str());
    std::fflush(stdout);
    return;
  }
  // Marks the configurations cuDNN does not support; building them then fails.
  auto support = g->check_support();
  const std::string support_text = support.is_good() ? "ok" : Escaped(support.get_message());
  const int64_t count = g->get_execution_plan_count();
  const int64_t xn = l.n * l.c * l.h * l.w, wn = l.k * l.c * l.r * l.r,
                yn = l.n * l.k * l.out_h() * l.out_w();
  Buffers b;
  std::unordered_map<int64_t, void*> pack;
  const bool forward = v == Variant::kConv || v == Variant::kConvStats ||
                       v == Variant::kPrologueConv || v == Variant::kPrologueConvStats;
  if (forward || v == Variant::kWgrad || v == Variant::kPrologueWgrad) {
    pack[kX] = b.Get(kX, xn * 4, 1.f);
  }
  if (v != Variant::kWgrad && v != Variant::kPrologueWgrad) pack[kW] = b.Get(kW, wn * 4, 0.05f);
  if (forward) pack[kY] = b.Get(kY, yn * 4, 0.f);
  if (v == Variant::kConvStats || v == Variant::kPrologueConvStats) {
    pack[kSum] = b.Get(kSum, l.k * 4, 0.f);
    pack[kSqSum] = b.Get(kSqSum, l.k * 4, 0.f);
  }
  if (v == Variant::kPrologueConv || v == Variant::kPrologueConvStats ||
      v == Variant::kPrologueWgrad) {
    pack[kScale] = b.Get(kScale, l.c * 4, 1.f);
    pack[kBias] = b.Get(kBias, l.c * 4, 0.1f);
  }
  if (!forward) pack[kDy] = b.Get(kDy, yn * 4, 1.f);
  if (v == Variant::kDgrad || v == Variant::kDgradDrelu) pack[kDx] = b.Get(kDx, xn * 4, 0.f);
  if (v == Variant::kDgradDrelu) pack[kAct] = b.Get(kAct, xn * 4, 1.f);
  if (v == Variant::kWgrad || v == Variant::kPrologueWgrad) pack[kDw] = b.Get(kDw, wn * 4, 0.f);

  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  int64_t built = 0, ran = 0, best_index = -1, best_workspace = 0;
  int64_t runtime_compiled = 0;
  float best_ms = 1e30f, first_ms = -1.f, build_s = 0.f;
  std::string best_name;
  for (int64_t i = 0; i < count && built < max_plans; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!g->build_plan_at_index(handle, i).is_good()) continue;
    build_s += std::chrono::duration<float>(std::chrono::steady_clock::now() - t0).count();
    ++built;
    std::vector<fe::BehaviorNote_t> notes;
    if (!g->get_behavior_notes_for_plan_at_index(i, notes).is_good()) notes.clear();
    const bool rtc = std::find(notes.begin(), notes.end(),
                               fe::BehaviorNote_t::RUNTIME_COMPILATION) != notes.end();
    runtime_compiled += rtc;
    int64_t workspace = 0;
    if (!g->get_workspace_size_plan_at_index(i, workspace).is_good()) continue;
    void* ws = nullptr;
    if (workspace > 0 && cudaMalloc(&ws, workspace) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    bool ok = g->execute_plan_at_index(handle, pack, ws, i).is_good() &&
              cudaDeviceSynchronize() == cudaSuccess;
    float ms = 1e30f;
    for (int r = 0; ok && r < repeats; ++r) {
      CUDA_CHECK(cudaEventRecord(start));
      ok = g->execute_plan_at_index(handle, pack, ws, i).is_good();
      CUDA_CHECK(cudaEventRecord(stop));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      ms = std::min(ms, t);
    }
    if (ws != nullptr) cudaFree(ws);
    if (!ok) {
      cudaGetLastError();
      continue;
    }
    ++ran;
    if (first_ms < 0) first_ms = ms;
    if (ms < best_ms) {
      best_ms = ms;
      best_index = i;
      best_workspace = workspace;
      if (!g->get_plan_name_at_index(i, best_name).is_good()) best_name = "?";
    }
  }
  std::printf("%s, \"configurations\": %lld, \"built\": %lld, \"runtime_compiled\": %lld, "
              "\"ran\": %lld, \"build_s\": %.2f, \"support\": \"%s\"",
              head.c_str(), (long long)count, (long long)built, (long long)runtime_compiled,
              (long long)ran, build_s, support_text.c_str());
  if (best_index >= 0) {
    std::printf(", \"best_ms\": %.4f, \"first_ms\": %.4f, \"best_plan\": \"%s\", "
                "\"best_workspace\": %lld",
                best_ms, first_ms, best_name.c_str(), (long long)best_workspace);
  }
  std::printf("}\n");
  std::fflush(stdout);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t max_plans = argc > 1 ? std::atoll(argv[1]) : 24;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  cudnnHandle_t handle;
  if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS) {
    std::fprintf(stderr, "cudnnCreate failed\n");
    return 1;
  }
  std::printf("{\"cudnn_version\": %zu, \"max_plans\": %lld, \"repeats\": %d}\n",
              cudnnGetVersion(), (long long)max_plans, repeats);
  const Layer layers[] = {
      {"res2_1x1_64_64", 128, 64, 56, 56, 64, 1, 1, 0},
      {"res2_3x3_64_64", 128, 64, 56, 56, 64, 3, 1, 1},
      {"res2_1x1_64_256", 128, 64, 56, 56, 256, 1, 1, 0},
      {"res3_3x3_128_128", 128, 128, 28, 28, 128, 3, 1, 1},
      {"res4_3x3_256_256", 128, 256, 14, 14, 256, 3, 1, 1},
      {"res4_1x1_256_1024", 128, 256, 14, 14, 1024, 1, 1, 0},
      {"res5_1x1_512_2048", 128, 512, 7, 7, 2048, 1, 1, 0},
  };
  const Variant variants[] = {Variant::kConv, Variant::kConvStats, Variant::kPrologueConv,
                              Variant::kPrologueConvStats, Variant::kDgrad,
                              Variant::kDgradDrelu, Variant::kWgrad, Variant::kPrologueWgrad};
  for (const Layer& l : layers) {
    for (Variant v : variants) Probe(handle, l, v, max_plans, repeats);
  }
  cudnnDestroy(handle);
  return 0;
}
