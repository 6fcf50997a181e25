// The OpKernel behind all six ops: reads attributes and the plan, resolves the geometry and the
// micro-batches, allocates the result and hands the work to a device's ConvLauncher.
#ifndef TF_UCUDNN_CC_CONV_CONV_OP_KERNEL_H_
#define TF_UCUDNN_CC_CONV_CONV_OP_KERNEL_H_

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cc/common/conv_geometry.h"
#include "cc/common/micro_batch_plan.h"
#include "cc/conv/conv_attrs.h"
#include "cc/conv/self_check.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_ucudnn {

// Specialized per device in conv_cpu.cc and conv_gpu.cc.
template <typename Device, typename T>
struct ConvLauncher {
  static absl::Status Run(tensorflow::OpKernelContext* ctx, ConvKernel kernel,
                          const ConvGeometry& geometry,
                          const std::vector<MicroBatch>& micro_batches, ConvBuffers<T> buffers);
  // `count` values of the device's `data` on the host, as doubles (for the self-check).
  static absl::Status ToHost(tensorflow::OpKernelContext* ctx, const T* data, int64_t count,
                             std::vector<double>* host);
};

// plan_batch_size: -1, or the batch size the plan is for, which it must add up to.
template <typename Construction>
absl::Status ReadPlanBatchSize(Construction* ctx, const MicroBatchPlan& plan,
                               int64_t* plan_batch_size) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("plan_batch_size", plan_batch_size));
  if (*plan_batch_size >= 0 && !plan.empty() && plan.total() != *plan_batch_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan ", plan.DebugString(), " sums to ", plan.total(),
                     " samples but is for batches of plan_batch_size=", *plan_batch_size));
  }
  return absl::OkStatus();
}

// The plan a batch of `batch` samples runs: the op's own, or none (undivided) for a batch of
// another size than plan_batch_size, where that is given.
inline const MicroBatchPlan& PlanFor(const MicroBatchPlan& plan, int64_t plan_batch_size,
                                     int64_t batch) {
  static const MicroBatchPlan* const kUndivided = new MicroBatchPlan();
  return plan_batch_size >= 0 && batch != plan_batch_size ? *kUndivided : plan;
}

inline std::vector<int64_t> Dims(const tensorflow::TensorShape& shape) {
  std::vector<int64_t> dims;
  for (int i = 0; i < shape.dims(); ++i) dims.push_back(shape.dim_size(i));
  return dims;
}

template <typename Device, typename T, ConvKernel kKernel, int kNumSpatialDims>
class UcudnnConvOp : public tensorflow::OpKernel {
 public:
  explicit UcudnnConvOp(tensorflow::OpKernelConstruction* ctx)
      : tensorflow::OpKernel(ctx),
        self_check_(SelfCheckFromEnvironment(tensorflow::DataTypeToEnum<T>::value)) {
    absl::Status status = ReadConvAttrs(ctx, kNumSpatialDims, &attrs_);
    OP_REQUIRES(ctx, status.ok(), Describe(status));
    status = ReadPlanAttrs(ctx, kKernel, OwnPlanAttrs(), &plan_);
    if (status.ok()) status = ReadPlanBatchSize(ctx, plan_, &plan_batch_size_);
    // The message already shows the rejected plan; plan_ itself stayed empty.
    OP_REQUIRES(ctx, status.ok(),
                absl::Status(status.code(), absl::StrCat(type_string(), " '", name(), "' (",
                                                         KernelName(kKernel), " kernel): ",
                                                         status.message())));
    // The plans this op's gradient will hand the backprop ops are checked here too, so that a
    // bad one fails where it was written, not in a later backward pass.
    if (kKernel == ConvKernel::kForward) {
      for (auto [kernel, names] : {std::make_pair(ConvKernel::kBackpropInput,
                                                  BackpropInputPlanAttrs()),
                                   std::make_pair(ConvKernel::kBackpropFilter,
                                                  BackpropFilterPlanAttrs())}) {
        MicroBatchPlan gradient_plan;
        status = ReadPlanAttrs(ctx, kernel, names, &gradient_plan);
        OP_REQUIRES(ctx, status.ok(),
                    absl::Status(status.code(),
                                 absl::StrCat(type_string(), " '", name(), "' (gradient's ",
                                              KernelName(kernel), " kernel): ",
                                              status.message())));
      }
    }
  }

  void Compute(tensorflow::OpKernelContext* ctx) override {
    std::vector<int64_t> input_shape, filter_shape;
    switch (kKernel) {
      case ConvKernel::kForward:
        input_shape = Dims(ctx->input(0).shape());
        filter_shape = Dims(ctx->input(1).shape());
        break;
      case ConvKernel::kBackpropInput:
        OP_REQUIRES_OK(ctx, ShapeFromSizes(ctx->input(0), "input_sizes", &input_shape));
        filter_shape = Dims(ctx->input(1).shape());
        break;
      case ConvKernel::kBackpropFilter:
        input_shape = Dims(ctx->input(0).shape());
        OP_REQUIRES_OK(ctx, ShapeFromSizes(ctx->input(1), "filter_sizes", &filter_shape));
        break;
    }
    ConvGeometry geometry;
    absl::Status status = ComputeConvGeometry(attrs_, input_shape, filter_shape, &geometry);
    if (status.ok() && kKernel != ConvKernel::kForward) {
      status = CheckOutputShape(geometry, Dims(ctx->input(2).shape()));
    }
    OP_REQUIRES(ctx, status.ok(), Describe(status));

    std::vector<MicroBatch> micro_batches;
    status = PlanFor(plan_, plan_batch_size_, geometry.batch)
                 .Resolve(geometry.batch, &micro_batches);
    // Checked on every device, though only cuDNN's kernels take a form other than direct.
    ConvForm form = ConvForm::kDirect;
    if (status.ok()) status = PlanForm(geometry, micro_batches, &form);
    OP_REQUIRES(ctx, status.ok(), Describe(status));

    tensorflow::Tensor* result = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, tensorflow::TensorShape(geometry.ResultShape(kKernel)), &result));

    ConvBuffers<T> buffers{};
    switch (kKernel) {
      case ConvKernel::kForward:
        buffers = {Mutable(ctx->input(0)), Mutable(ctx->input(1)), Mutable(*result)};
        break;
      case ConvKernel::kBackpropInput:
        buffers = {Mutable(*result), Mutable(ctx->input(1)), Mutable(ctx->input(2))};
        break;
      case ConvKernel::kBackpropFilter:
        buffers = {Mutable(ctx->input(0)), Mutable(*result), Mutable(ctx->input(2))};
        break;
    }
    status = ConvLauncher<Device, T>::Run(ctx, kKernel, geometry, micro_batches, buffers);
    if (status.ok() && self_check_.enabled && geometry.batch > 0 && !checked_.exchange(true)) {
      status = CheckAgainstReference(ctx, geometry, buffers, *result);
    }
    OP_REQUIRES(ctx, status.ok(), Describe(status));
  }

 private:
  // Errors name the op, the node, the plan and the reason.
  absl::Status Describe(const absl::Status& status) const {
    if (status.ok()) return status;
    return absl::Status(status.code(),
                        absl::StrCat(type_string(), " '", name(), "' (", KernelName(kKernel),
                                     " kernel, plan ", plan_.DebugString(), "): ",
                                     status.message()));
  }

  // The self-check (self_check.h): this run's result against one undivided reference run.
  absl::Status CheckAgainstReference(tensorflow::OpKernelContext* ctx,
                                     const ConvGeometry& geometry, ConvBuffers<T> buffers,
                                     const tensorflow::Tensor& result) {
    tensorflow::Tensor reference;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(result.dtype(), result.shape(), &reference));
    ConvBuffers<T> reference_buffers = buffers;
    T* reference_data = Mutable(reference);
    switch (kKernel) {
      case ConvKernel::kForward:
        reference_buffers.output = reference_data;
        break;
      case ConvKernel::kBackpropInput:
        reference_buffers.input = reference_data;
        break;
      case ConvKernel::kBackpropFilter:
        reference_buffers.filter = reference_data;
        break;
    }
    const MicroBatch whole = ReferenceMicroBatch(geometry.batch);
    absl::Status status =
        ConvLauncher<Device, T>::Run(ctx, kKernel, geometry, {whole}, reference_buffers);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("self-check: the reference run (undivided, ",
                                       whole.algorithm.ToString(), ") failed: ",
                                       status.message()));
    }
    std::vector<double> planned, expected;
    TF_RETURN_IF_ERROR(ConvLauncher<Device, T>::ToHost(ctx, Mutable(result),
                                                       result.NumElements(), &planned));
    TF_RETURN_IF_ERROR(ConvLauncher<Device, T>::ToHost(ctx, reference_data,
                                                       reference.NumElements(), &expected));
    const double error = NormalizedL2Error(planned, expected);
    if (!(error <= self_check_.tolerance)) {
      return absl::InternalError(absl::StrCat(
          "self-check failed: the planned result's normalized L2 error against one undivided "
          "run of the reference algorithm (", whole.algorithm.ToString(), ") is ", error,
          ", over the tolerance of ", self_check_.tolerance));
    }
    return absl::OkStatus();
  }

  static absl::Status ShapeFromSizes(const tensorflow::Tensor& sizes, const char* what,
                                     std::vector<int64_t>* shape) {
    if (sizes.dims() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " must be a vector, got shape ", sizes.shape().DebugString()));
    }
    shape->clear();
    for (int64_t i = 0; i < sizes.NumElements(); ++i) {
      const int64_t dim = sizes.dtype() == tensorflow::DT_INT64 ? sizes.vec<int64_t>()(i)
                                                                 : sizes.vec<int32_t>()(i);
      if (dim < 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, " has a negative dimension"));
      }
      shape->push_back(dim);
    }
    return absl::OkStatus();
  }

  static T* Mutable(const tensorflow::Tensor& tensor) {
    return const_cast<T*>(tensor.flat<T>().data());
  }

  ConvAttrs attrs_;
  MicroBatchPlan plan_;
  int64_t plan_batch_size_ = -1;
  const SelfCheckSetting self_check_;
  std::atomic<bool> checked_{false};  // the first run only
};

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CONV_CONV_OP_KERNEL_H_
