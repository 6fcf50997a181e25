// One convolution's cuDNN calls, shared by the op kernels and the XLA custom call (Run: a plan's
// micro-batches) and the profiler (Profile: every algorithm at candidate micro-batch sizes), so
// all see the same descriptors, layouts, padding and math.
#ifndef TF_UCUDNN_CC_CUDNN_CONVOLUTION_H_
#define TF_UCUDNN_CC_CUDNN_CONVOLUTION_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "absl/status/status.h"
#include "cc/common/conv_geometry.h"
#include "cc/common/micro_batch_plan.h"
#include "cc/cudnn/conv_resources.h"
#include "cc/cudnn/cudnn_support.h"
#include "cc/cudnn/engines.h"
#include "cc/cudnn/layout.h"
#include "cc/cudnn/strided_copy.h"

namespace tf_ucudnn {

// One cuDNN call's choice: the algorithm, its math and its workspace (for a graph-API engine
// configuration, algo stays -1: the micro-batch's AlgorithmSpec names the engine).
struct ResolvedCall {
  int algo = -1;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace = 0;
};

// Where a convolution's filter (or filter gradient) lives: in TensorFlow's layout, copied to and
// from cuDNN's around the calls, or already in cuDNN's, as an XLA custom call's operand laid out
// by CudnnLayout::FilterMinorToMajor (XLA then makes the copy, next to the ops around it).
enum class FilterLayout { kTensorFlow, kCudnn };

// Which candidates Profile times: the legacy algorithms (cudnnFind*AlgorithmEx) or the
// graph-API engine configurations cuDNN's heuristics offer (each timed with events).
enum class ProfiledCandidates { kLegacy, kEngines };

// One algorithm's or engine configuration's run at one micro-batch size.
struct AlgorithmMeasurement {
  int64_t batch = 0;
  AlgorithmSpec algorithm;  // explicit: a legacy algorithm with its math, or an engine
  float time_ms = 0;
  size_t workspace = 0;
  bool deterministic = false;
};

class CudnnConvolution {
 public:
  // `buffers` are the op's tensors, of `type` elements; Run writes the one its kernel computes,
  // Profile none. `g` must outlive the convolution. It runs in one `form` (CudnnLayout): only
  // micro-batches planned in it, and profiles in it. Its filter is in `filter_layout` (Profile
  // takes TensorFlow's).
  CudnnConvolution(ConvResources* resources, ConvKernel kernel, const ConvGeometry& g,
                   cudnnDataType_t type, ConvBuffers<void> buffers,
                   ConvForm form = ConvForm::kDirect,
                   FilterLayout filter_layout = FilterLayout::kTensorFlow);

  // Resolves each micro-batch's call (its algorithm made explicit) and the device memory the
  // calls need together, without running anything: an XLA custom call is sized this way when it
  // is compiled. Needs no buffers; the current device is the one planned for.
  absl::Status Prepare(const std::vector<MicroBatch>& micro_batches,
                       std::vector<ResolvedCall>* calls, size_t* scratch_bytes);

  absl::Status Run(const std::vector<MicroBatch>& micro_batches);

  // Times every candidate cuDNN can run at each micro-batch size with up to `workspace_limit`
  // bytes of workspace, on real buffers: the legacy algorithms (cudnnFind*AlgorithmEx, with
  // TensorFlow's math for this type) or the engine configurations. A micro-batch of size n uses
  // the first n samples; results go to scratch buffers. In a form other than direct, each time
  // includes the micro-batch's copies and each workspace the copy of its input.
  absl::Status Profile(const std::vector<int64_t>& sizes, size_t workspace_limit,
                       ProfiledCandidates candidates,
                       std::vector<AlgorithmMeasurement>* measurements);

 private:
  struct SizeDescriptors {
    TensorDescriptor input;  // padded, when padding is asymmetric
    TensorDescriptor output;
  };
  struct Candidate;

  // convolution.cc: descriptors, memory and execution.
  absl::Status Begin();
  absl::Status Descriptors(int64_t size, SizeDescriptors** out);
  absl::Status CheckForm() const;
  absl::Status ResolveAll(std::vector<ResolvedCall>* calls, size_t* workspace_bytes);
  absl::Status ZeroResultOfEmptyBatch();
  std::vector<size_t> BufferSizes(size_t workspace_bytes) const;
  absl::Status AllocateBuffers(size_t workspace_bytes);
  absl::Status AllocateElements(int64_t elements, void** memory);
  void* Element(void* base, int64_t index) const;
  absl::Status Copy(const StridedCopy& copy, const void* src, void* dst);
  absl::Status CudnnOperands(void* input, void* output, int64_t size, void** cudnn_input,
                             void** cudnn_output);
  absl::Status Execute(size_t index, const ResolvedCall& call);
  absl::Status CopyResultBack(size_t index, void* cudnn_input, void* input, void* cudnn_output,
                              void* output);
  absl::Status CopyInputGradientBack(int64_t size, void* cudnn_input, void* input);
  absl::Status ExecuteEngineCall(size_t index, void* cudnn_input, void* cudnn_output,
                                 void* workspace);
  EngineProblem Problem(int64_t size) const;
  bool AccumulatesEngineFilters() const;
  std::string Where(size_t index) const;
  std::string AlgorithmText(int algo) const;

  // convolution_algorithm.cc: which algorithm each micro-batch runs.
  absl::Status CachedResolve(size_t index, ResolvedCall* call);
  absl::Status Resolve(size_t index, ResolvedCall* call);
  absl::Status Heuristics(const SizeDescriptors& d, std::vector<Candidate>* candidates);
  absl::Status WorkspaceSize(const SizeDescriptors& d, int algo, size_t* bytes);

  // convolution_profile.cc: timing every algorithm.
  absl::Status Find(const SizeDescriptors& d, void* cudnn_input, void* cudnn_output,
                    void* workspace, size_t workspace_bytes, int64_t size,
                    std::vector<AlgorithmMeasurement>* measurements);
  absl::Status TimeEngines(void* cudnn_input, void* cudnn_output, void* workspace,
                           size_t workspace_bytes, int64_t size,
                           std::vector<AlgorithmMeasurement>* measurements);
  absl::Status TimeFormCopies(int64_t size, void* cudnn_input, void* cudnn_output,
                              float* time_ms);

  ConvResources* resources_;
  const ConvKernel kernel_;
  const ConvGeometry& g_;
  const cudnnDataType_t type_;
  const CudnnLayout layout_;
  const FilterLayout filter_layout_;
  ConvBuffers<void> buffers_;
  std::vector<MicroBatch> micro_batches_;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  ScopedCudaDevice scoped_device_;
  CudnnHandleLease handle_;
  FilterDescriptor filter_desc_;
  ConvolutionDescriptor conv_desc_;
  std::map<int64_t, std::unique_ptr<SizeDescriptors>> descriptors_;
  // Device memory from the resources, in the order BufferSizes gives them.
  void* workspace_ = nullptr;
  void* cudnn_filter_ = nullptr;  // the op's own filter where it is in cuDNN's layout
  void* cudnn_input_ = nullptr;   // padded, transposed or in another form
  void* cudnn_output_ = nullptr;  // transposed
  // A micro-batch's filter gradient from an engine, which overwrites its output, before it is
  // added to the others'.
  void* engine_filter_ = nullptr;
};

// The engine problem of `kernel` at `size` samples of `g` laid out as `layout` on `device` (under
// TensorFlow's op determinism, deterministic configurations only).
EngineProblem EngineProblemOf(ConvKernel kernel, const ConvGeometry& g, const CudnnLayout& layout,
                              cudnnDataType_t type, int64_t size, int device);

// Runs a plan's micro-batches, each one cuDNN call; the op kernels and the XLA custom call alike.
absl::Status RunConvolution(ConvResources* resources, ConvKernel kernel,
                            const ConvGeometry& geometry,
                            const std::vector<MicroBatch>& micro_batches, cudnnDataType_t type,
                            ConvBuffers<void> buffers,
                            FilterLayout filter_layout = FilterLayout::kTensorFlow);

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_CONVOLUTION_H_
