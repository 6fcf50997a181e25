// XLA kernels of the batch normalization ops: XLA's own training batch norm forward, and the
// gradient written out from the saved statistics (as the CPU and cuDNN kernels compute it), so
// XLA fuses both with the ops around them.
#include <vector>

#include "cc/xla/xla_registration.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "xla/hlo/builder/xla_builder.h"

namespace tf_ucudnn {
namespace {

using ::tensorflow::XlaOpKernelContext;

class UcudnnBatchNormXlaOp : public tensorflow::XlaOpKernel {
 public:
  explicit UcudnnBatchNormXlaOp(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
  }

  void Compile(XlaOpKernelContext* ctx) override {
    const int feature = ctx->InputShape(0).dims() - 1;
    xla::XlaOp normalized =
        xla::BatchNormTraining(ctx->Input(0), ctx->Input(1), ctx->Input(2), epsilon_, feature);
    xla::XlaOp variance = xla::GetTupleElement(normalized, 2);
    ctx->SetOutput(0, xla::GetTupleElement(normalized, 0));
    ctx->SetOutput(1, xla::GetTupleElement(normalized, 1));
    ctx->SetOutput(2, xla::Rsqrt(variance + xla::ConstantR0<float>(ctx->builder(), epsilon_)));
  }

 private:
  float epsilon_ = 0;
};

class UcudnnBatchNormGradXlaOp : public tensorflow::XlaOpKernel {
 public:
  explicit UcudnnBatchNormGradXlaOp(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {}

  void Compile(XlaOpKernelContext* ctx) override {
    const tensorflow::TensorShape shape = ctx->InputShape(1);
    const int feature = shape.dims() - 1;
    std::vector<int64_t> dims, reduced;
    for (int d = 0; d < shape.dims(); ++d) {
      dims.push_back(shape.dim_size(d));
      if (d != feature) reduced.push_back(d);
    }
    const int64_t rows = shape.num_elements() / std::max<int64_t>(1, shape.dim_size(feature));
    xla::XlaBuilder* b = ctx->builder();
    auto per_element = [&](xla::XlaOp vector) {
      return xla::BroadcastInDim(vector, dims, {feature});
    };
    auto sum = [&](xla::XlaOp values) {
      return xla::Reduce(values, xla::ConstantR0<float>(b, 0),
                         *ctx->GetOrCreateAdd(tensorflow::DT_FLOAT), reduced);
    };
    xla::XlaOp dy = ctx->Input(0), x = ctx->Input(1), scale = ctx->Input(2);
    xla::XlaOp inv_std = ctx->Input(4);
    xla::XlaOp x_hat = (x - per_element(ctx->Input(3))) * per_element(inv_std);
    xla::XlaOp offset_backprop = sum(dy);
    xla::XlaOp scale_backprop = sum(dy * x_hat);
    // dx = scale * inv_std / rows * (rows * dy - sum(dy) - x_hat * sum(dy * x_hat))
    xla::XlaOp count = xla::ConstantR0<float>(b, static_cast<float>(rows));
    xla::XlaOp dx = per_element(scale * inv_std / count) *
                    (count * dy - per_element(offset_backprop) - x_hat * per_element(scale_backprop));
    ctx->SetOutput(0, dx);
    ctx->SetOutput(1, scale_backprop);
    ctx->SetOutput(2, offset_backprop);
  }
};

REGISTER_UCUDNN_XLA_OP(tensorflow::XlaOpRegistrationBuilder::Name("UcudnnBatchNorm"),
                       UcudnnBatchNormXlaOp);
REGISTER_UCUDNN_XLA_OP(tensorflow::XlaOpRegistrationBuilder::Name("UcudnnBatchNormGrad"),
                       UcudnnBatchNormGradXlaOp);

}  // namespace
}  // namespace tf_ucudnn
