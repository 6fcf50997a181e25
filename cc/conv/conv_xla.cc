// XLA kernels of the six convolution ops, so that tf.function(jit_compile=True) compiles them:
//   - on the GPU, one custom call that runs the plan's micro-batches, each its own cuDNN call, on
//     XLA's stream (conv_custom_call.h);
//   - elsewhere, one HLO convolution per micro-batch: slices of the batch, the results
//     concatenated (filter gradients summed).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/conv/conv_attrs.h"
#include "cc/conv/conv_custom_call.h"
#include "cc/conv/conv_op_kernel.h"
#include "cc/xla/xla_registration.h"
#include "tensorflow/compiler/tf2xla/kernels/conv_op_helpers.h"
#include "tensorflow/compiler/tf2xla/shape_util.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

namespace tf_ucudnn {
namespace {

using ::tensorflow::XlaOpKernelContext;

std::string MlirArray(const std::vector<int64_t>& values) {
  return values.empty() ? "array<i64>" : absl::StrCat("array<i64: ", absl::StrJoin(values, ", "),
                                                      ">");
}

std::string MlirString(const std::string& text) {
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += c;
  }
  return quoted + "\"";
}

template <ConvKernel kKernel, int kNumSpatialDims>
class UcudnnConvXlaOp : public tensorflow::XlaOpKernel {
  // The first input of type T (the others before it are shapes).
  static constexpr int kTypedInput = kKernel == ConvKernel::kBackpropInput ? 1 : 0;

 public:
  explicit UcudnnConvXlaOp(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadConvAttrs(ctx, kNumSpatialDims, &attrs_));
    OP_REQUIRES_OK(ctx, ReadPlanAttrs(ctx, kKernel, OwnPlanAttrs(), &plan_));
    OP_REQUIRES_OK(ctx, ReadPlanBatchSize(ctx, plan_, &plan_batch_size_));
    auto conv_attrs = tensorflow::ConvOpAttrs::Create(kNumSpatialDims, /*depthwise=*/false, ctx);
    OP_REQUIRES_OK(ctx, conv_attrs.status());
    conv_attrs_ = *conv_attrs;
  }

  void Compile(XlaOpKernelContext* ctx) override {
    std::vector<int64_t> input_shape, filter_shape;
    tensorflow::TensorShape sizes;
    switch (kKernel) {
      case ConvKernel::kForward:
        input_shape = Dims(ctx->InputShape(0));
        filter_shape = Dims(ctx->InputShape(1));
        break;
      case ConvKernel::kBackpropInput:
        OP_REQUIRES_OK(ctx, ctx->ConstantInputAsShape(0, &sizes));
        input_shape = Dims(sizes);
        filter_shape = Dims(ctx->InputShape(1));
        break;
      case ConvKernel::kBackpropFilter:
        input_shape = Dims(ctx->InputShape(0));
        OP_REQUIRES_OK(ctx, ctx->ConstantInputAsShape(1, &sizes));
        filter_shape = Dims(sizes);
        break;
    }
    ConvGeometry geometry;
    absl::Status status = ComputeConvGeometry(attrs_, input_shape, filter_shape, &geometry);
    if (status.ok() && kKernel != ConvKernel::kForward) {
      status = CheckOutputShape(geometry, Dims(ctx->InputShape(2)));
    }
    const MicroBatchPlan& plan = PlanFor(plan_, plan_batch_size_, geometry.batch);
    std::vector<MicroBatch> micro_batches;
    if (status.ok()) status = plan.Resolve(geometry.batch, &micro_batches);
    OP_REQUIRES_OK(ctx, Describe(status));

    // An undivided batch outside the plan is XLA's own convolution, as the plan's absence says.
    const bool custom_call = ctx->op_kernel_context()->device()->device_type() ==
                             tensorflow::DEVICE_GPU_XLA_JIT && &plan == &plan_;
    auto result = custom_call ? CustomCall(ctx, geometry, micro_batches)
                              : Convolutions(ctx, geometry, micro_batches);
    OP_REQUIRES_OK(ctx, Describe(result.status()));
    ctx->SetOutput(0, *result);
  }

 private:
  std::string Label() const { return absl::StrCat(type_string(), " '", name(), "'"); }

  absl::Status Describe(const absl::Status& status) const {
    if (status.ok()) return status;
    return absl::Status(status.code(),
                        absl::StrCat(Label(), " (", KernelName(kKernel), " kernel, plan ",
                                     plan_.DebugString(), ", compiled by XLA): ",
                                     status.message()));
  }

  // One HLO convolution per micro-batch, each on its slice of the batch: of the input, or for the
  // input's gradient, of the output's gradient.
  absl::StatusOr<xla::XlaOp> Convolutions(XlaOpKernelContext* ctx, const ConvGeometry& g,
                                          const std::vector<MicroBatch>& micro_batches) {
    const std::string type = type_string();
    const xla::PrimitiveType element = ctx->input_xla_type(kTypedInput);
    auto slice = [](xla::XlaOp operand, const MicroBatch& mb) {
      return xla::SliceInDim(operand, mb.offset, mb.offset + mb.size, 1, /*dimno=*/0);
    };
    // One micro-batch (or an empty batch) is the op itself.
    const bool whole = micro_batches.size() <= 1;
    std::vector<xla::XlaOp> parts;
    switch (kKernel) {
      case ConvKernel::kForward: {
        if (whole) return tensorflow::MakeXlaForwardConvOp(type, ctx->Input(0), ctx->Input(1),
                                                           conv_attrs_);
        for (const MicroBatch& mb : micro_batches) {
          TF_ASSIGN_OR_RETURN(xla::XlaOp part,
                              tensorflow::MakeXlaForwardConvOp(type, slice(ctx->Input(0), mb),
                                                               ctx->Input(1), conv_attrs_));
          parts.push_back(part);
        }
        return xla::ConcatInDim(ctx->builder(), parts, 0);
      }
      case ConvKernel::kBackpropInput: {
        if (whole) {
          return tensorflow::MakeXlaBackpropInputConvOp(
              type, xla::ShapeUtil::MakeShape(element, g.InputShape(g.batch)), ctx->Input(1),
              ctx->Input(2), conv_attrs_);
        }
        for (const MicroBatch& mb : micro_batches) {
          TF_ASSIGN_OR_RETURN(
              xla::XlaOp part,
              tensorflow::MakeXlaBackpropInputConvOp(
                  type, xla::ShapeUtil::MakeShape(element, g.InputShape(mb.size)), ctx->Input(1),
                  slice(ctx->Input(2), mb), conv_attrs_));
          parts.push_back(part);
        }
        return xla::ConcatInDim(ctx->builder(), parts, 0);
      }
      case ConvKernel::kBackpropFilter: {
        const xla::Shape filter = xla::ShapeUtil::MakeShape(element, g.FilterShape());
        if (whole) {
          return tensorflow::MakeXlaBackpropFilterConvOp(type, ctx->Input(0), filter,
                                                         ctx->Input(2), conv_attrs_);
        }
        xla::XlaOp sum;
        for (const MicroBatch& mb : micro_batches) {
          TF_ASSIGN_OR_RETURN(xla::XlaOp part, tensorflow::MakeXlaBackpropFilterConvOp(
                                                   type, slice(ctx->Input(0), mb), filter,
                                                   slice(ctx->Input(2), mb), conv_attrs_));
          sum = sum.valid() ? xla::Add(sum, part) : part;
        }
        return sum;
      }
    }
    return absl::InternalError("unknown kernel");
  }

  absl::StatusOr<xla::XlaOp> CustomCall(XlaOpKernelContext* ctx, const ConvGeometry& g,
                                        const std::vector<MicroBatch>& micro_batches) {
#if GOOGLE_CUDA
    ConvCustomCall call;
    TF_RETURN_IF_ERROR(PlanConvCustomCall(ctx->input_type(kTypedInput), kKernel, g,
                                          micro_batches, Label(), &call));
    // The tensors, not the shapes: forward (input, filter), backprop input (filter, gradient),
    // backprop filter (input, gradient).
    const std::vector<int> operands =
        kKernel == ConvKernel::kForward ? std::vector<int>{0, 1}
        : kKernel == ConvKernel::kBackpropInput ? std::vector<int>{1, 2}
                                                : std::vector<int>{0, 2};
    const xla::PrimitiveType element = ctx->input_xla_type(kTypedInput);
    // The filter, operand or result, as cuDNN's filter is laid out where it can be: XLA makes
    // that copy itself, beside the ops around the call, and shares it between the forward pass
    // and the input gradient. Every other tensor is row-major, as TensorFlow's.
    auto shape_of = [&](const std::vector<int64_t>& dims, bool filter) {
      return filter && !call.filter_minor_to_major.empty()
                 ? xla::ShapeUtil::MakeShapeWithDenseLayout(element, dims,
                                                            call.filter_minor_to_major)
                 : xla::ShapeUtil::MakeShapeWithDescendingLayout(element, dims);
    };
    std::vector<xla::XlaOp> operand_ops;
    std::vector<xla::Shape> operand_shapes;
    for (int index : operands) {
      operand_ops.push_back(ctx->Input(index));
      // Input 1 is the filter of the forward pass and of the input gradient.
      operand_shapes.push_back(shape_of(Dims(ctx->InputShape(index)), /*filter=*/index == 1));
    }
    const xla::Shape result_shape = xla::ShapeUtil::MakeTupleShape(
        {shape_of(g.ResultShape(kKernel), /*filter=*/kKernel == ConvKernel::kBackpropFilter),
         xla::ShapeUtil::MakeShapeWithDescendingLayout(
             xla::U8, {static_cast<int64_t>(call.scratch_bytes)})});
    xla::XlaOp results = xla::CustomCallWithLayout(
        ctx->builder(), kConvCustomCallTarget, operand_ops, result_shape, operand_shapes,
        call.BackendConfig(), /*has_side_effect=*/false, /*output_operand_aliasing=*/{},
        /*literal=*/nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
        xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    return xla::GetTupleElement(results, 0);
#else
    return absl::FailedPreconditionError(
        "tf_ucudnn was built without its cuDNN kernels, so XLA cannot run it on the GPU; "
        "rebuild it where nvcc and cuDNN are found");
#endif
  }

  ConvAttrs attrs_;
  MicroBatchPlan plan_;
  int64_t plan_batch_size_ = -1;
  tensorflow::ConvOpAttrs conv_attrs_;
};

#define UCUDNN_XLA_CONV(op, kernel, nd, sizes_input)                                       \
  using op##XlaOp = UcudnnConvXlaOp<kernel, nd>;                                           \
  REGISTER_UCUDNN_XLA_OP(                                                                  \
      tensorflow::XlaOpRegistrationBuilder::Name(#op) sizes_input, op##XlaOp)

UCUDNN_XLA_CONV(UcudnnConv2D, ConvKernel::kForward, 2, );
UCUDNN_XLA_CONV(UcudnnConv2DBackpropInput, ConvKernel::kBackpropInput, 2,
                .CompileTimeConstantInput("input_sizes"));
UCUDNN_XLA_CONV(UcudnnConv2DBackpropFilter, ConvKernel::kBackpropFilter, 2,
                .CompileTimeConstantInput("filter_sizes"));
UCUDNN_XLA_CONV(UcudnnConv3D, ConvKernel::kForward, 3, );
UCUDNN_XLA_CONV(UcudnnConv3DBackpropInput, ConvKernel::kBackpropInput, 3,
                .CompileTimeConstantInput("input_sizes"));
UCUDNN_XLA_CONV(UcudnnConv3DBackpropFilter, ConvKernel::kBackpropFilter, 3,
                .CompileTimeConstantInput("filter_sizes"));

}  // namespace

std::string ConvCustomCall::BackendConfig() const {
  std::vector<int64_t> sizes;
  std::vector<std::string> algorithms;
  for (const MicroBatch& mb : micro_batches) {
    sizes.push_back(mb.size);
    algorithms.push_back(mb.algorithm.ToString());
  }
  return absl::StrCat("{kernel = ", static_cast<int>(kernel), " : i64, geometry = ",
                      MlirArray(geometry.Encode()), ", sizes = ", MlirArray(sizes),
                      ", algorithms = ", MlirString(absl::StrJoin(algorithms, ";")),
                      ", cudnn_filter_layout = ", filter_minor_to_major.empty() ? 0 : 1,
                      " : i64, op_name = ", MlirString(op_name), "}");
}

}  // namespace tf_ucudnn
