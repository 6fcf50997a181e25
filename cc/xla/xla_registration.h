// REGISTER_XLA_OP for a library loaded at any time. XLA makes the compilation kernels of the ops
// registered with it once, when it is first used; an op registered after that (its library
// loaded after a first jit_compile) would have none. REGISTER_UCUDNN_XLA_OP registers the op
// with XLA and, if that moment has passed, its compilation kernels for every XLA backend too.
#ifndef TF_UCUDNN_CC_XLA_XLA_REGISTRATION_H_
#define TF_UCUDNN_CC_XLA_XLA_REGISTRATION_H_

#include <utility>

#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tf_ucudnn {

class UcudnnXlaOpRegistrar {
 public:
  UcudnnXlaOpRegistrar(tensorflow::XlaOpRegistrationBuilder&& builder,
                       tensorflow::XlaOpRegistry::Factory factory);
};

}  // namespace tf_ucudnn

#define REGISTER_UCUDNN_XLA_OP(BUILDER, OP) \
  REGISTER_UCUDNN_XLA_OP_UNIQ_HELPER(__COUNTER__, BUILDER, OP)
#define REGISTER_UCUDNN_XLA_OP_UNIQ_HELPER(COUNTER, BUILDER, OP) \
  REGISTER_UCUDNN_XLA_OP_UNIQ(COUNTER, BUILDER, OP)
#define REGISTER_UCUDNN_XLA_OP_UNIQ(COUNTER, BUILDER, OP)                               \
  static ::tf_ucudnn::UcudnnXlaOpRegistrar ucudnn_xla_op_registrar_##COUNTER(           \
      std::move(BUILDER), [](::tensorflow::OpKernelConstruction* context) -> ::tensorflow::OpKernel* { \
        return new OP(context);                                                          \
      })

#endif  // TF_UCUDNN_CC_XLA_XLA_REGISTRATION_H_
