// The GPU side of the XLA custom call (see conv_custom_call.h): planning it when the op compiles,
// and the typed FFI handler XLA runs on its own stream.
#if GOOGLE_CUDA

#include "cc/conv/conv_custom_call.h"

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cc/cudnn/conv_resources.h"
#include "cc/cudnn/convolution.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "xla/ffi/api/ffi.h"

namespace xla::ffi {
// Exported by TensorFlow's framework library (xla/ffi/ffi_api.h, whose other includes a plugin
// does not need): the FFI API of the XLA inside this process.
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace xla::ffi

namespace tf_ucudnn {
namespace {

namespace ffi = ::xla::ffi;

// Planning runs nothing: no stream, and no memory.
class PlanningResources : public ConvResources {
 public:
  explicit PlanningResources(std::string label) : label_(std::move(label)) {}
  cudaStream_t stream() override { return nullptr; }
  absl::Status Allocate(size_t, void**) override {
    return absl::InternalError(absl::StrCat(label_, ": no memory is allocated while planning"));
  }
  std::string label() const override { return label_; }

 private:
  std::string label_;
};

bool HasZeroSize(const ConvGeometry& g) {
  return g.FilterSize() == 0 || g.InputSampleSize() == 0 || g.OutputSampleSize() == 0;
}

absl::Status Plan(cudnnDataType_t type, const std::vector<MicroBatch>& micro_batches,
                  ConvCustomCall* call) {
  call->micro_batches = micro_batches;
  call->scratch_bytes = 0;
  if (micro_batches.empty() || HasZeroSize(call->geometry)) return absl::OkStatus();
  PlanningResources resources(call->op_name);
  std::vector<ResolvedCall> resolved;
  ConvForm form = ConvForm::kDirect;
  TF_RETURN_IF_ERROR(PlanForm(call->geometry, micro_batches, &form));
  call->filter_minor_to_major =
      CudnnLayout(call->geometry, type == CUDNN_DATA_DOUBLE, form).FilterMinorToMajor();
  const FilterLayout filter_layout = call->filter_minor_to_major.empty()
                                         ? FilterLayout::kTensorFlow
                                         : FilterLayout::kCudnn;
  TF_RETURN_IF_ERROR(CudnnConvolution(&resources, call->kernel, call->geometry, type,
                                      ConvBuffers<void>{}, form, filter_layout)
                         .Prepare(micro_batches, &resolved, &call->scratch_bytes));
  for (size_t i = 0; i < resolved.size(); ++i) {
    AlgorithmSpec& spec = call->micro_batches[i].algorithm;
    if (spec.is_engine()) continue;  // its execution plan is built when it first runs
    spec.automatic = false;
    spec.algo = resolved[i].algo;
    spec.math = static_cast<MathMode>(resolved[i].math);
  }
  return absl::OkStatus();
}

absl::Status Run(cudaStream_t stream, const ConvCustomCall& call, FilterLayout filter_layout,
                 cudnnDataType_t type, ffi::AnyBuffer first, ffi::AnyBuffer second,
                 ffi::AnyBuffer result, ffi::AnyBuffer scratch) {
  ConvBuffers<void> buffers{};
  switch (call.kernel) {
    case ConvKernel::kForward:
      buffers = {first.untyped_data(), second.untyped_data(), result.untyped_data()};
      break;
    case ConvKernel::kBackpropInput:
      buffers = {result.untyped_data(), first.untyped_data(), second.untyped_data()};
      break;
    case ConvKernel::kBackpropFilter:
      buffers = {first.untyped_data(), result.untyped_data(), second.untyped_data()};
      break;
  }
  ScratchResources resources(stream, scratch.untyped_data(), scratch.size_bytes(), call.op_name);
  return RunConvolution(&resources, call.kernel, call.geometry, call.micro_batches, type,
                        buffers, filter_layout);
}

ffi::Error ToFfiError(const absl::Status& status) {
  if (status.ok()) return ffi::Error::Success();
  const auto code = status.code() == absl::StatusCode::kInvalidArgument
                        ? ffi::ErrorCode::kInvalidArgument
                    : status.code() == absl::StatusCode::kResourceExhausted
                        ? ffi::ErrorCode::kResourceExhausted
                        : ffi::ErrorCode::kInternal;
  return ffi::Error(code, std::string(status.message()));
}

ffi::Error RunCustomCall(cudaStream_t stream, ffi::AnyBuffer first, ffi::AnyBuffer second,
                         ffi::Result<ffi::AnyBuffer> result, ffi::Result<ffi::AnyBuffer> scratch,
                         int64_t kernel, ffi::Span<const int64_t> geometry,
                         ffi::Span<const int64_t> sizes, std::string_view algorithms,
                         int64_t cudnn_filter_layout, std::string_view op_name) {
  ConvCustomCall call;
  call.op_name = std::string(op_name);
  absl::Status status = ConvGeometry::Decode(geometry.begin(), geometry.size(), &call.geometry);
  const std::vector<std::string> texts =
      algorithms.empty() ? std::vector<std::string>{}
                         : absl::StrSplit(absl::string_view(algorithms.data(), algorithms.size()),
                                          ';');
  if (kernel < 0 || kernel > 2 || sizes.size() != texts.size() || cudnn_filter_layout < 0 ||
      cudnn_filter_layout > 1) {
    status = absl::InvalidArgumentError("malformed kernel or plan attributes");
  }
  if (status.ok()) {
    call.kernel = static_cast<ConvKernel>(kernel);
    std::vector<int64_t> plan_sizes(sizes.begin(), sizes.end());
    MicroBatchPlan plan;
    status = MicroBatchPlan::FromAttrs(call.kernel, plan_sizes, texts, &plan);
    if (status.ok()) status = plan.Resolve(plan.total(), &call.micro_batches);
  }
  if (!status.ok()) {
    return ToFfiError(absl::Status(status.code(),
                                   absl::StrCat(call.op_name, ": ", status.message())));
  }
  const FilterLayout layout =
      cudnn_filter_layout ? FilterLayout::kCudnn : FilterLayout::kTensorFlow;
  switch (first.element_type()) {
    case ffi::DataType::F32:
      return ToFfiError(
          Run(stream, call, layout, CUDNN_DATA_FLOAT, first, second, *result, *scratch));
    case ffi::DataType::F16:
      return ToFfiError(
          Run(stream, call, layout, CUDNN_DATA_HALF, first, second, *result, *scratch));
    case ffi::DataType::BF16:
      return ToFfiError(
          Run(stream, call, layout, CUDNN_DATA_BFLOAT16, first, second, *result, *scratch));
    case ffi::DataType::F64:
      return ToFfiError(
          Run(stream, call, layout, CUDNN_DATA_DOUBLE, first, second, *result, *scratch));
    default:
      return ToFfiError(
          absl::InvalidArgumentError(absl::StrCat(call.op_name, ": unsupported data type")));
  }
}

}  // namespace

absl::Status PlanConvCustomCall(tensorflow::DataType dtype, ConvKernel kernel,
                                const ConvGeometry& geometry,
                                const std::vector<MicroBatch>& micro_batches,
                                const std::string& op_name, ConvCustomCall* call) {
  call->kernel = kernel;
  call->geometry = geometry;
  call->op_name = op_name;
  switch (dtype) {
    case tensorflow::DT_FLOAT:
      return Plan(CUDNN_DATA_FLOAT, micro_batches, call);
    case tensorflow::DT_HALF:
      return Plan(CUDNN_DATA_HALF, micro_batches, call);
    case tensorflow::DT_BFLOAT16:
      return Plan(CUDNN_DATA_BFLOAT16, micro_batches, call);
    case tensorflow::DT_DOUBLE:
      return Plan(CUDNN_DATA_DOUBLE, micro_batches, call);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(op_name, ": no cuDNN convolution for ", tensorflow::DataTypeString(dtype)));
  }
}

XLA_FFI_DEFINE_HANDLER(kConvCustomCallHandler, RunCustomCall,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("kernel")
                           .Attr<ffi::Span<const int64_t>>("geometry")
                           .Attr<ffi::Span<const int64_t>>("sizes")
                           .Attr<std::string_view>("algorithms")
                           .Attr<int64_t>("cudnn_filter_layout")
                           .Attr<std::string_view>("op_name"));

XLA_FFI_REGISTER_HANDLER(ffi::GetXlaFfiApi(), kConvCustomCallTarget, "CUDA",
                         kConvCustomCallHandler);

}  // namespace tf_ucudnn

#endif  // GOOGLE_CUDA
