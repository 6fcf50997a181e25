// One convolution's cuDNN calls, shared by the op kernels (Run: a plan's micro-batches) and the
// profiler (Profile: every algorithm at candidate micro-batch sizes), so both see the same
// descriptors, layouts, padding and math.
#ifndef TF_UCUDNN_CC_KERNELS_CUDNN_CONVOLUTION_H_
#define TF_UCUDNN_CC_KERNELS_CUDNN_CONVOLUTION_H_

#define EIGEN_USE_GPU

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/kernels/conv_op_kernel.h"
#include "cc/kernels/conv_resources.h"
#include "cc/kernels/cudnn_support.h"
#include "cc/kernels/strided_copy.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/util/determinism.h"
#include "tsl/platform/tensor_float_32_utils.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_ucudnn {
namespace cudnn_internal {

template <typename T>
struct CudnnTypes;
template <>
struct CudnnTypes<Eigen::half> {
  static constexpr cudnnDataType_t kData = CUDNN_DATA_HALF;
  static constexpr cudnnDataType_t kCompute = CUDNN_DATA_FLOAT;
  using Scale = float;
};
template <>
struct CudnnTypes<tensorflow::bfloat16> {
  static constexpr cudnnDataType_t kData = CUDNN_DATA_BFLOAT16;
  static constexpr cudnnDataType_t kCompute = CUDNN_DATA_FLOAT;
  using Scale = float;
};
template <>
struct CudnnTypes<float> {
  static constexpr cudnnDataType_t kData = CUDNN_DATA_FLOAT;
  static constexpr cudnnDataType_t kCompute = CUDNN_DATA_FLOAT;
  using Scale = float;
};
template <>
struct CudnnTypes<double> {
  static constexpr cudnnDataType_t kData = CUDNN_DATA_DOUBLE;
  static constexpr cudnnDataType_t kCompute = CUDNN_DATA_DOUBLE;
  using Scale = double;
};

inline const char* AlgorithmName(ConvKernel kernel, int algo) {
  static const char* const kForward[] = {"IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM",
                                         "DIRECT", "FFT", "FFT_TILING", "WINOGRAD",
                                         "WINOGRAD_NONFUSED"};
  static const char* const kBackpropInput[] = {"ALGO_0", "ALGO_1", "FFT", "FFT_TILING",
                                               "WINOGRAD", "WINOGRAD_NONFUSED"};
  static const char* const kBackpropFilter[] = {"ALGO_0",   "ALGO_1",
                                                "FFT",      "ALGO_3",
                                                "WINOGRAD", "WINOGRAD_NONFUSED",
                                                "FFT_TILING"};
  if (algo < 0 || algo >= AlgorithmCount(kernel)) return "?";
  switch (kernel) {
    case ConvKernel::kForward:
      return kForward[algo];
    case ConvKernel::kBackpropInput:
      return kBackpropInput[algo];
    case ConvKernel::kBackpropFilter:
      return kBackpropFilter[algo];
  }
  return "?";
}

// cuDNN's documentation lists these as non-deterministic (atomics across thread blocks); every
// forward algorithm is deterministic.
inline bool IsDeterministic(ConvKernel kernel, int algo) {
  switch (kernel) {
    case ConvKernel::kForward:
      return true;
    case ConvKernel::kBackpropInput:
      return algo != CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;
    case ConvKernel::kBackpropFilter:
      return algo != CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 &&
             algo != CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
  }
  return false;
}

inline const char* MathName(cudnnMathType_t math) {
  switch (math) {
    case CUDNN_DEFAULT_MATH:
      return "default";
    case CUDNN_TENSOR_OP_MATH:
      return "tensor_op";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
      return "tensor_op_allow_conversion";
    case CUDNN_FMA_MATH:
      return "fma";
  }
  return "?";
}

// The math TensorFlow's own Conv2D would use: float32 follows the TF32 setting
// (tf.config.experimental.enable_tensor_float_32_execution), half types use tensor cores,
// double stays on FMA units.
inline cudnnMathType_t TensorFlowMath(cudnnDataType_t type) {
  switch (type) {
    case CUDNN_DATA_FLOAT:
      return tsl::tensor_float_32_execution_enabled() ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    case CUDNN_DATA_HALF:
    case CUDNN_DATA_BFLOAT16:
      return CUDNN_TENSOR_OP_MATH;
    default:
      return CUDNN_FMA_MATH;
  }
}

// Heuristic results may propose another math type than asked; take those that are no less exact.
inline bool MathAcceptable(cudnnMathType_t proposed, cudnnMathType_t asked, cudnnDataType_t type) {
  if (proposed == asked || proposed == CUDNN_FMA_MATH) return true;
  // Default math may use TF32 on float32 data, which only tensor-op math permits.
  return proposed == CUDNN_DEFAULT_MATH && (type != CUDNN_DATA_FLOAT || asked != CUDNN_FMA_MATH);
}

// TensorFlow's own knob for how much workspace its autotuner may give one convolution.
inline size_t AutomaticWorkspaceLimit() {
  static const size_t limit = [] {
    const char* text = std::getenv("TF_CUDNN_WORKSPACE_LIMIT_IN_MB");
    const long long megabytes = text != nullptr ? std::atoll(text) : 4096;
    return static_cast<size_t>(std::max(0LL, megabytes)) << 20;
  }();
  return limit;
}

// TF_UCUDNN_LOG_CALLS=1 logs every cuDNN call with its micro-batch, to see a plan execute.
inline bool LogCalls() {
  static const bool enabled = [] {
    const char* text = std::getenv("TF_UCUDNN_LOG_CALLS");
    return text != nullptr && std::string(text) == "1";
  }();
  return enabled;
}

// Dims in cuDNN's logical order: [N, C, spatial...] for tensors, [K, C, spatial...] for filters.
inline std::vector<int64_t> LogicalDims(int64_t outer, int64_t channels,
                                 const std::vector<int64_t>& spatial) {
  std::vector<int64_t> dims = {outer, channels};
  dims.insert(dims.end(), spatial.begin(), spatial.end());
  return dims;
}

// Packed strides of `dims` (in its own storage order).
inline std::vector<int64_t> PackedStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (int d = static_cast<int>(dims.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * dims[d + 1];
  }
  return strides;
}

// Strides, per logical [N, C, spatial...] dim, of a packed tensor in channels-last or -first order.
inline std::vector<int64_t> LogicalStrides(const std::vector<int64_t>& logical, bool channels_last) {
  const int nd = static_cast<int>(logical.size()) - 2;
  std::vector<int64_t> storage = {logical[0]};
  if (!channels_last) storage.push_back(logical[1]);
  for (int i = 0; i < nd; ++i) storage.push_back(logical[2 + i]);
  if (channels_last) storage.push_back(logical[1]);
  const std::vector<int64_t> packed = PackedStrides(storage);
  std::vector<int64_t> strides(logical.size());
  strides[0] = packed[0];
  strides[1] = channels_last ? packed.back() : packed[1];
  for (int i = 0; i < nd; ++i) strides[2 + i] = packed[channels_last ? 1 + i : 2 + i];
  return strides;
}

// Strides, per logical [K, C, spatial...] dim, of TensorFlow's filter layout [spatial..., C, K].
inline std::vector<int64_t> TensorFlowFilterStrides(const ConvGeometry& g) {
  const int nd = g.num_spatial_dims();
  std::vector<int64_t> storage = g.filter_spatial;
  storage.push_back(g.in_channels);
  storage.push_back(g.out_channels);
  const std::vector<int64_t> packed = PackedStrides(storage);
  std::vector<int64_t> strides = {packed[nd + 1], packed[nd]};
  for (int i = 0; i < nd; ++i) strides.push_back(packed[i]);
  return strides;
}

// A copy between two tensors of the same logical [outer, C, spatial...] dims.
inline StridedCopy MakeCopy(const std::vector<int64_t>& dims, const std::vector<int64_t>& dst_strides,
                     const std::vector<int64_t>& src_dims,
                     const std::vector<int64_t>& src_strides,
                     const std::vector<int64_t>& src_start) {
  StridedCopy copy;
  copy.rank = static_cast<int>(dims.size());
  for (int d = 0; d < copy.rank; ++d) {
    copy.dims[d] = dims[d];
    copy.dst_strides[d] = dst_strides[d];
    copy.src_dims[d] = src_dims[d];
    copy.src_strides[d] = src_strides[d];
    copy.src_start[d] = src_start[d];
  }
  return copy;
}

// One cuDNN call's choice: the algorithm, its math and its workspace.
struct ResolvedCall {
  int algo = -1;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace = 0;
};

// One algorithm's run at one micro-batch size, as cudnnFind*AlgorithmEx timed it.
struct AlgorithmMeasurement {
  int64_t batch = 0;
  int algo = -1;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  float time_ms = 0;
  size_t workspace = 0;
  bool deterministic = false;
};

template <typename T>
class CudnnConvolution {
 public:
  // `buffers` are the op's tensors; Run writes the one its kernel computes, Profile none.
  CudnnConvolution(ConvResources* resources, ConvKernel kernel, const ConvGeometry& g,
                   ConvBuffers<T> buffers)
      : resources_(resources), kernel_(kernel), g_(g), buffers_(buffers) {}

  // Resolves each micro-batch's call (its algorithm made explicit) and the device memory the
  // calls need together, without running anything: an XLA custom call is sized this way when it
  // is compiled. Needs no buffers; the current device is the one planned for.
  absl::Status Prepare(const std::vector<MicroBatch>& micro_batches,
                       std::vector<ResolvedCall>* calls, size_t* scratch_bytes) {
    micro_batches_ = micro_batches;
    size_t workspace_bytes = 0;
    TF_RETURN_IF_ERROR(ResolveAll(calls, &workspace_bytes));
    *scratch_bytes = PackedBytes(BufferSizes(workspace_bytes));
    return absl::OkStatus();
  }

  absl::Status Run(const std::vector<MicroBatch>& micro_batches) {
    micro_batches_ = micro_batches;
    if (micro_batches_.empty()) return ZeroResultOfEmptyBatch();
    std::vector<ResolvedCall> calls;
    size_t workspace_bytes = 0;
    TF_RETURN_IF_ERROR(ResolveAll(&calls, &workspace_bytes));
    TF_RETURN_IF_ERROR(AllocateBuffers(workspace_bytes));
    if (kernel_ != ConvKernel::kBackpropFilter) TF_RETURN_IF_ERROR(FilterToCudnnLayout());
    for (size_t i = 0; i < micro_batches_.size(); ++i) {
      TF_RETURN_IF_ERROR(Execute(i, calls[i]));
    }
    if (kernel_ == ConvKernel::kBackpropFilter) TF_RETURN_IF_ERROR(FilterFromCudnnLayout());
    return absl::OkStatus();
  }

  // Times every algorithm cuDNN can run at each micro-batch size (cudnnFind*AlgorithmEx, real
  // buffers, TensorFlow's math for this dtype) with up to `workspace_limit` bytes of workspace.
  // Micro-batch i of size n uses the first n samples; results go to scratch buffers.
  absl::Status Profile(const std::vector<int64_t>& sizes, size_t workspace_limit,
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
    // Results go to scratch; operands are copied where cuDNN needs another layout or padding.
    if (kernel_ == ConvKernel::kForward && !transposed_) {
      TF_RETURN_IF_ERROR(AllocateElements(largest * g_.OutputSampleSize(), &buffers_.output));
    } else if (kernel_ == ConvKernel::kBackpropInput && !needs_input_copy_) {
      TF_RETURN_IF_ERROR(AllocateElements(largest * g_.InputSampleSize(), &buffers_.input));
    }
    if (kernel_ != ConvKernel::kBackpropFilter) TF_RETURN_IF_ERROR(FilterToCudnnLayout());
    T* cudnn_input = needs_input_copy_ ? CudnnInput() : buffers_.input;
    if (needs_input_copy_ && kernel_ != ConvKernel::kBackpropInput) {
      TF_RETURN_IF_ERROR(Copy(InputCopy(largest, /*to_cudnn=*/true), buffers_.input, cudnn_input));
    }
    T* cudnn_output = transposed_ ? CudnnOutput() : buffers_.output;
    if (transposed_ && kernel_ != ConvKernel::kForward) {
      TF_RETURN_IF_ERROR(
          Copy(OutputCopy(largest, /*to_cudnn=*/true), buffers_.output, cudnn_output));
    }
    TF_RETURN_IF_ERROR(conv_desc_.SetMath(TensorFlowMath(kData)));
    void* workspace = workspace_limit > 0 ? workspace_ : nullptr;
    for (int64_t size : sizes) {
      SizeDescriptors* d;
      TF_RETURN_IF_ERROR(Descriptors(size, &d));
      TF_RETURN_IF_ERROR(
          Find(*d, cudnn_input, cudnn_output, workspace, workspace_limit, size, measurements));
    }
    return absl::OkStatus();
  }

 private:
  using Scale = typename CudnnTypes<T>::Scale;
  static constexpr cudnnDataType_t kData = CudnnTypes<T>::kData;

  absl::Status Begin() {
    stream_ = resources_->stream();
    if (buffers_.filter != nullptr) {
      TF_RETURN_IF_ERROR(DeviceOfPointer(buffers_.filter, &device_));
    } else {
      TF_UCUDNN_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device_), "cudaGetDevice");
    }
    TF_RETURN_IF_ERROR(scoped_device_.Enter(device_));
    TF_RETURN_IF_ERROR(AcquireCudnnHandle(device_, stream_, &handle_));
    return DescribeConvolution();
  }

  absl::Status ResolveAll(std::vector<ResolvedCall>* calls, size_t* workspace_bytes) {
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
  absl::Status ZeroResultOfEmptyBatch() {
    if (kernel_ != ConvKernel::kBackpropFilter || g_.FilterSize() == 0) return absl::OkStatus();
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(buffers_.filter, 0, g_.FilterSize() * sizeof(T), resources_->stream()),
        "cudaMemsetAsync");
    return absl::OkStatus();
  }

  // cuDNN pads symmetrically: it gets the smaller side of each dimension, and the rest is added
  // to a copy of the micro-batch's input. cuDNN's legacy API has no float64 kernels for
  // channels-last layouts (TensorFlow runs those channels-first too), so float64 NHWC/NDHWC
  // micro-batches are transposed on their way in and out.
  absl::Status DescribeConvolution() {
    cudnn_channels_last_ = g_.channels_last && kData != CUDNN_DATA_DOUBLE;
    transposed_ = cudnn_channels_last_ != g_.channels_last;
    const int nd = g_.num_spatial_dims();
    std::vector<int64_t> symmetric(nd);
    padded_spatial_ = g_.input_spatial;
    extra_before_.assign(nd, 0);
    for (int i = 0; i < nd; ++i) {
      symmetric[i] = std::min(g_.pad_before[i], g_.pad_after[i]);
      extra_before_[i] = g_.pad_before[i] - symmetric[i];
      padded_spatial_[i] += extra_before_[i] + g_.pad_after[i] - symmetric[i];
      needs_input_copy_ = needs_input_copy_ || padded_spatial_[i] != g_.input_spatial[i];
    }
    needs_input_copy_ = needs_input_copy_ || transposed_;
    TF_RETURN_IF_ERROR(filter_desc_.Init(
        kData, cudnn_channels_last_, LogicalDims(g_.out_channels, g_.in_channels, g_.filter_spatial)));
    return conv_desc_.Init(symmetric, g_.strides, g_.dilations, CudnnTypes<T>::kCompute,
                           TensorFlowMath(kData));
  }

  struct SizeDescriptors {
    TensorDescriptor input;  // padded, when padding is asymmetric
    TensorDescriptor output;
  };

  absl::Status Descriptors(int64_t size, SizeDescriptors** out) {
    std::unique_ptr<SizeDescriptors>& slot = descriptors_[size];
    if (slot == nullptr) {
      auto created = std::make_unique<SizeDescriptors>();
      TF_RETURN_IF_ERROR(created->input.Init(
          kData, cudnn_channels_last_, LogicalDims(size, g_.in_channels, padded_spatial_)));
      TF_RETURN_IF_ERROR(created->output.Init(
          kData, cudnn_channels_last_, LogicalDims(size, g_.out_channels, g_.output_spatial)));
      slot = std::move(created);
    }
    *out = slot.get();
    return absl::OkStatus();
  }

  std::string Where(size_t index) const {
    const MicroBatch& mb = micro_batches_[index];
    return absl::StrCat("micro-batch ", index, " (samples ", mb.offset, "..",
                        mb.offset + mb.size - 1, ")");
  }

  std::string AlgorithmText(int algo) const {
    return absl::StrCat(algo, " (", AlgorithmName(kernel_, algo), ")");
  }

  absl::Status WorkspaceSize(const SizeDescriptors& d, int algo, size_t* bytes) {
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

  static absl::Status ToStatus(cudnnStatus_t status) {
    return status == CUDNN_STATUS_SUCCESS ? absl::OkStatus() : FromCudnn(status, "cuDNN");
  }

  struct Candidate {
    int algo;
    cudnnMathType_t math;
    size_t memory;
  };

  // cuDNN's heuristics, best first (the *_v7 queries need no buffers and run no kernels).
  absl::Status Heuristics(const SizeDescriptors& d, std::vector<Candidate>* candidates) {
    constexpr int kMaxResults = 16;
    int returned = 0;
    cudnnHandle_t h = handle_.get();
    candidates->clear();
    switch (kernel_) {
      case ConvKernel::kForward: {
        cudnnConvolutionFwdAlgoPerf_t perf[kMaxResults];
        TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
            cudnnGetConvolutionForwardAlgorithm_v7(h, d.input.get(), filter_desc_.get(),
                                                   conv_desc_.get(), d.output.get(), kMaxResults,
                                                   &returned, perf),
            "cudnnGetConvolutionForwardAlgorithm_v7");
        for (int i = 0; i < returned; ++i) {
          if (perf[i].status == CUDNN_STATUS_SUCCESS) {
            candidates->push_back({perf[i].algo, perf[i].mathType, perf[i].memory});
          }
        }
        break;
      }
      case ConvKernel::kBackpropInput: {
        cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxResults];
        TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
            cudnnGetConvolutionBackwardDataAlgorithm_v7(h, filter_desc_.get(), d.output.get(),
                                                        conv_desc_.get(), d.input.get(),
                                                        kMaxResults, &returned, perf),
            "cudnnGetConvolutionBackwardDataAlgorithm_v7");
        for (int i = 0; i < returned; ++i) {
          if (perf[i].status == CUDNN_STATUS_SUCCESS) {
            candidates->push_back({perf[i].algo, perf[i].mathType, perf[i].memory});
          }
        }
        break;
      }
      case ConvKernel::kBackpropFilter: {
        cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxResults];
        TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
            cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.input.get(), d.output.get(),
                                                          conv_desc_.get(), filter_desc_.get(),
                                                          kMaxResults, &returned, perf),
            "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
        for (int i = 0; i < returned; ++i) {
          if (perf[i].status == CUDNN_STATUS_SUCCESS) {
            candidates->push_back({perf[i].algo, perf[i].mathType, perf[i].memory});
          }
        }
        break;
      }
    }
    return absl::OkStatus();
  }

  template <typename Perf>
  static void Record(const Perf* perf, int returned, int64_t size,
                     std::vector<AlgorithmMeasurement>* measurements) {
    for (int i = 0; i < returned; ++i) {
      if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
      measurements->push_back({size, static_cast<int>(perf[i].algo), perf[i].mathType,
                               perf[i].time, perf[i].memory,
                               perf[i].determinism == CUDNN_DETERMINISTIC});
    }
  }

  absl::Status Find(const SizeDescriptors& d, T* cudnn_input, T* cudnn_output, void* workspace,
                    size_t workspace_bytes, int64_t size,
                    std::vector<AlgorithmMeasurement>* measurements) {
    constexpr int kMaxResults = 32;
    int returned = 0;
    cudnnHandle_t h = handle_.get();
    const std::string what = absl::StrCat("cudnnFind ", KernelName(kernel_), " at ", size,
                                          " samples for ", g_.DebugString());
    switch (kernel_) {
      case ConvKernel::kForward: {
        cudnnConvolutionFwdAlgoPerf_t perf[kMaxResults];
        TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
            cudnnFindConvolutionForwardAlgorithmEx(
                h, d.input.get(), cudnn_input, filter_desc_.get(), CudnnFilter(),
                conv_desc_.get(), d.output.get(), cudnn_output, kMaxResults, &returned, perf,
                workspace, workspace_bytes),
            what);
        Record(perf, returned, size, measurements);
        break;
      }
      case ConvKernel::kBackpropInput: {
        cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxResults];
        TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
            cudnnFindConvolutionBackwardDataAlgorithmEx(
                h, filter_desc_.get(), CudnnFilter(), d.output.get(), cudnn_output,
                conv_desc_.get(), d.input.get(), cudnn_input, kMaxResults, &returned, perf,
                workspace, workspace_bytes),
            what);
        Record(perf, returned, size, measurements);
        break;
      }
      case ConvKernel::kBackpropFilter: {
        cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxResults];
        TF_UCUDNN_RETURN_IF_CUDNN_ERROR(
            cudnnFindConvolutionBackwardFilterAlgorithmEx(
                h, d.input.get(), cudnn_input, d.output.get(), cudnn_output,
                conv_desc_.get(), filter_desc_.get(), CudnnFilter(), kMaxResults, &returned,
                perf, workspace, workspace_bytes),
            what);
        Record(perf, returned, size, measurements);
        break;
      }
    }
    return absl::OkStatus();
  }

  // Resolving asks cuDNN for heuristics and workspace sizes, which in cuDNN 9 takes longer on
  // the host than a small micro-batch takes on the GPU. The answer depends only on the key, so
  // it is kept for the life of the process (failures are not kept: they end the step anyway).
  absl::Status CachedResolve(size_t index, ResolvedCall* call) {
    static std::mutex* mutex = new std::mutex;
    static auto* cache = new std::map<std::string, ResolvedCall>;
    const MicroBatch& mb = micro_batches_[index];
    const std::string key = absl::StrCat(
        device_, "|", KernelName(kernel_), "|", static_cast<int>(kData), "|",
        g_.channels_last, "|", g_.DebugString(), "|", mb.size, "|", mb.algorithm.ToString(), "|",
        static_cast<int>(TensorFlowMath(kData)), "|", tensorflow::OpDeterminismRequired(), "|",
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
  absl::Status Resolve(size_t index, ResolvedCall* call) {
    const MicroBatch& mb = micro_batches_[index];
    SizeDescriptors* d;
    TF_RETURN_IF_ERROR(Descriptors(mb.size, &d));
    const bool deterministic = tensorflow::OpDeterminismRequired();
    const cudnnMathType_t tensorflow_math = TensorFlowMath(kData);
    if (mb.algorithm.automatic) {
      std::vector<Candidate> candidates;
      TF_RETURN_IF_ERROR(conv_desc_.SetMath(tensorflow_math));
      TF_RETURN_IF_ERROR(Heuristics(*d, &candidates));
      for (const Candidate& c : candidates) {
        if (!MathAcceptable(c.math, tensorflow_math, kData)) continue;
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
                                       AlgorithmText(algo), " with ", MathName(math),
                                       " math for ", g_.DebugString(), " (", status.message(),
                                       ")"));
    }
    *call = {algo, math, bytes};
    return absl::OkStatus();
  }

  // Bytes of the workspace, cuDNN's copy of the filter, the padded (or transposed) input and the
  // transposed output, in the order AllocateBuffers takes them.
  std::vector<size_t> BufferSizes(size_t workspace_bytes) const {
    int64_t largest = 0;
    for (const MicroBatch& mb : micro_batches_) largest = std::max(largest, mb.size);
    int64_t padded_sample = g_.in_channels;
    for (int64_t dim : padded_spatial_) padded_sample *= dim;
    return {workspace_bytes, g_.FilterSize() * sizeof(T),
            needs_input_copy_ ? largest * padded_sample * sizeof(T) : 0,
            transposed_ ? largest * g_.OutputSampleSize() * sizeof(T) : 0};
  }

  absl::Status AllocateBuffers(size_t workspace_bytes) {
    const std::vector<size_t> sizes = BufferSizes(workspace_bytes);
    void** buffers[] = {&workspace_, reinterpret_cast<void**>(&cudnn_filter_),
                        reinterpret_cast<void**>(&cudnn_input_),
                        reinterpret_cast<void**>(&cudnn_output_)};
    for (size_t i = 0; i < sizes.size(); ++i) {
      *buffers[i] = nullptr;
      if (sizes[i] > 0) TF_RETURN_IF_ERROR(resources_->Allocate(sizes[i], buffers[i]));
    }
    return absl::OkStatus();
  }

  absl::Status AllocateElements(int64_t elements, T** memory) {
    void* allocated = nullptr;
    TF_RETURN_IF_ERROR(resources_->Allocate(elements * sizeof(T), &allocated));
    *memory = static_cast<T*>(allocated);
    return absl::OkStatus();
  }

  T* CudnnFilter() { return cudnn_filter_; }
  T* CudnnInput() { return cudnn_input_; }
  T* CudnnOutput() { return cudnn_output_; }

  absl::Status Copy(const StridedCopy& copy, const T* src, T* dst) {
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(LaunchStridedCopy(copy, src, dst, sizeof(T), stream_),
                                   "layout copy kernel");
    return absl::OkStatus();
  }

  absl::Status FilterToCudnnLayout() {
    const auto dims = LogicalDims(g_.out_channels, g_.in_channels, g_.filter_spatial);
    return Copy(MakeCopy(dims, LogicalStrides(dims, cudnn_channels_last_), dims,
                         TensorFlowFilterStrides(g_), std::vector<int64_t>(dims.size(), 0)),
                buffers_.filter, CudnnFilter());
  }

  absl::Status FilterFromCudnnLayout() {
    const auto dims = LogicalDims(g_.out_channels, g_.in_channels, g_.filter_spatial);
    return Copy(MakeCopy(dims, TensorFlowFilterStrides(g_), dims,
                         LogicalStrides(dims, cudnn_channels_last_),
                         std::vector<int64_t>(dims.size(), 0)),
                CudnnFilter(), buffers_.filter);
  }

  // Between a micro-batch of the op's input and cuDNN's copy of it (padded, maybe transposed);
  // `start` is where the destination's origin lies in the source.
  StridedCopy InputCopy(int64_t size, bool to_cudnn) {
    const auto input = LogicalDims(size, g_.in_channels, g_.input_spatial);
    const auto padded = LogicalDims(size, g_.in_channels, padded_spatial_);
    std::vector<int64_t> start(input.size(), 0);
    for (size_t i = 0; i < extra_before_.size(); ++i) {
      start[2 + i] = to_cudnn ? -extra_before_[i] : extra_before_[i];
    }
    const auto input_strides = LogicalStrides(input, g_.channels_last);
    const auto padded_strides = LogicalStrides(padded, cudnn_channels_last_);
    return to_cudnn ? MakeCopy(padded, padded_strides, input, input_strides, start)
                    : MakeCopy(input, input_strides, padded, padded_strides, start);
  }

  // Between a micro-batch of the op's output (or its gradient) and cuDNN's transposed copy.
  StridedCopy OutputCopy(int64_t size, bool to_cudnn) {
    const auto dims = LogicalDims(size, g_.out_channels, g_.output_spatial);
    const auto op_strides = LogicalStrides(dims, g_.channels_last);
    const auto cudnn_strides = LogicalStrides(dims, cudnn_channels_last_);
    const std::vector<int64_t> start(dims.size(), 0);
    return to_cudnn ? MakeCopy(dims, cudnn_strides, dims, op_strides, start)
                    : MakeCopy(dims, op_strides, dims, cudnn_strides, start);
  }

  absl::Status Execute(size_t index, const ResolvedCall& call) {
    const MicroBatch& mb = micro_batches_[index];
    SizeDescriptors* d;
    TF_RETURN_IF_ERROR(Descriptors(mb.size, &d));
    TF_RETURN_IF_ERROR(conv_desc_.SetMath(call.math));
    T* input = buffers_.input + mb.offset * g_.InputSampleSize();
    T* output = buffers_.output + mb.offset * g_.OutputSampleSize();
    T* cudnn_input = needs_input_copy_ ? CudnnInput() : input;
    if (needs_input_copy_ && kernel_ != ConvKernel::kBackpropInput) {
      TF_RETURN_IF_ERROR(Copy(InputCopy(mb.size, /*to_cudnn=*/true), input, cudnn_input));
    }
    T* cudnn_output = transposed_ ? CudnnOutput() : output;
    if (transposed_ && kernel_ != ConvKernel::kForward) {
      TF_RETURN_IF_ERROR(Copy(OutputCopy(mb.size, /*to_cudnn=*/true), output, cudnn_output));
    }
    void* workspace = call.workspace > 0 ? workspace_ : nullptr;
    const Scale one = 1, zero = 0;
    // Filter gradients of all micro-batches add up in place.
    const Scale* beta = kernel_ == ConvKernel::kBackpropFilter && index > 0 ? &one : &zero;
    cudnnHandle_t h = handle_.get();
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    switch (kernel_) {
      case ConvKernel::kForward:
        status = cudnnConvolutionForward(
            h, &one, d->input.get(), cudnn_input, filter_desc_.get(), CudnnFilter(),
            conv_desc_.get(), static_cast<cudnnConvolutionFwdAlgo_t>(call.algo), workspace,
            call.workspace, beta, d->output.get(), cudnn_output);
        break;
      case ConvKernel::kBackpropInput:
        status = cudnnConvolutionBackwardData(
            h, &one, filter_desc_.get(), CudnnFilter(), d->output.get(), cudnn_output,
            conv_desc_.get(), static_cast<cudnnConvolutionBwdDataAlgo_t>(call.algo), workspace,
            call.workspace, beta, d->input.get(), cudnn_input);
        break;
      case ConvKernel::kBackpropFilter:
        status = cudnnConvolutionBackwardFilter(
            h, &one, d->input.get(), cudnn_input, d->output.get(), cudnn_output, conv_desc_.get(),
            static_cast<cudnnConvolutionBwdFilterAlgo_t>(call.algo), workspace, call.workspace,
            beta, filter_desc_.get(), CudnnFilter());
        break;
    }
    if (LogCalls()) {
      LOG(INFO) << resources_->label() << " "
                << KernelName(kernel_) << " cuDNN call " << index + 1 << "/"
                << micro_batches_.size() << ": " << mb.size << " samples at " << mb.offset
                << ", algo=" << call.algo << ",math=" << MathName(call.math) << ", workspace "
                << call.workspace << " bytes: " << cudnnGetErrorString(status);
    }
    if (status != CUDNN_STATUS_SUCCESS) {
      return FromCudnn(status, absl::StrCat(Where(index), ": cuDNN ", KernelName(kernel_),
                                            " with algorithm ", AlgorithmText(call.algo), " and ",
                                            MathName(call.math), " math failed for ",
                                            g_.DebugString()));
    }
    if (needs_input_copy_ && kernel_ == ConvKernel::kBackpropInput) {
      TF_RETURN_IF_ERROR(Copy(InputCopy(mb.size, /*to_cudnn=*/false), cudnn_input, input));
    }
    if (transposed_ && kernel_ == ConvKernel::kForward) {
      TF_RETURN_IF_ERROR(Copy(OutputCopy(mb.size, /*to_cudnn=*/false), cudnn_output, output));
    }
    return absl::OkStatus();
  }

  ConvResources* resources_;
  const ConvKernel kernel_;
  const ConvGeometry& g_;
  ConvBuffers<T> buffers_;
  std::vector<MicroBatch> micro_batches_;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  ScopedCudaDevice scoped_device_;
  CudnnHandleLease handle_;
  FilterDescriptor filter_desc_;
  ConvolutionDescriptor conv_desc_;
  std::map<int64_t, std::unique_ptr<SizeDescriptors>> descriptors_;
  std::vector<int64_t> padded_spatial_;
  std::vector<int64_t> extra_before_;
  bool cudnn_channels_last_ = false;  // the layout cuDNN sees
  bool transposed_ = false;           // ... differs from the op's
  bool needs_input_copy_ = false;     // padded or transposed input
  void* workspace_ = nullptr;
  T* cudnn_filter_ = nullptr;
  T* cudnn_input_ = nullptr;
  T* cudnn_output_ = nullptr;
};


}  // namespace cudnn_internal

using cudnn_internal::AlgorithmMeasurement;
using cudnn_internal::CudnnConvolution;
using cudnn_internal::ResolvedCall;

// Runs a plan's micro-batches, each one cuDNN call; the op kernels and the XLA custom call alike.
template <typename T>
absl::Status RunConvolution(ConvResources* resources, ConvKernel kernel,
                            const ConvGeometry& geometry,
                            const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> buffers) {
  // Zero-sized dims leave nothing for cuDNN to compute; the result is zeros (or empty).
  if (geometry.FilterSize() == 0 || geometry.InputSampleSize() == 0 ||
      geometry.OutputSampleSize() == 0) {
    const int64_t elements =
        kernel == ConvKernel::kForward
            ? geometry.batch * geometry.OutputSampleSize()
            : kernel == ConvKernel::kBackpropInput ? geometry.batch * geometry.InputSampleSize()
                                                   : geometry.FilterSize();
    T* result = kernel == ConvKernel::kForward         ? buffers.output
                : kernel == ConvKernel::kBackpropInput ? buffers.input
                                                       : buffers.filter;
    if (elements == 0) return absl::OkStatus();
    TF_UCUDNN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(result, 0, elements * sizeof(T), resources->stream()),
        "cudaMemsetAsync");
    return absl::OkStatus();
  }
  return CudnnConvolution<T>(resources, kernel, geometry, buffers).Run(micro_batches);
}

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_KERNELS_CUDNN_CONVOLUTION_H_
