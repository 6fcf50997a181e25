// REGISTER_UCUDNN_XLA_OP's registrar: XLA's own, plus the compilation kernels XLA would have
// made had the op been registered before its first use.
#include "cc/xla/xla_registration.h"

#include <memory>
#include <string>
#include <utility>

#include "tensorflow/core/framework/kernel_def.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def.pb.h"

namespace tf_ucudnn {
namespace {

// Whether XLA has made its compilation kernels: TensorFlow's own Identity then has one.
bool CompilationKernelsMade() {
  const tensorflow::KernelList kernels = tensorflow::GetRegisteredKernelsForOp("Identity");
  for (const tensorflow::KernelDef& kernel : kernels.kernel()) {
    if (kernel.device_type() == tensorflow::DEVICE_CPU_XLA_JIT) return true;
  }
  return false;
}

// As XLA makes them: each type attribute constrained to what the op allows (tf_ucudnn's ops allow
// only types every XLA backend supports).
void RegisterCompilationKernels(const std::string& op_name,
                                tensorflow::XlaOpRegistry::Factory factory) {
  const tensorflow::OpDef* op_def = nullptr;
  TF_CHECK_OK(tensorflow::OpRegistry::Global()->LookUpOpDef(op_name, &op_def));
  for (const std::string& backend : tensorflow::XlaOpRegistry::BackendNames()) {
    auto* kernel_def = new tensorflow::KernelDef;
    kernel_def->set_op(op_name);
    kernel_def->set_device_type(backend);
    for (const tensorflow::OpDef::AttrDef& attr : op_def->attr()) {
      if (attr.type() != "type") continue;
      auto* constraint = kernel_def->add_constraint();
      constraint->set_name(attr.name());
      *constraint->mutable_allowed_values() = attr.allowed_values();
    }
    // Registrars live as long as the process, as XLA's own do.
    new tensorflow::kernel_factory::OpKernelRegistrar(kernel_def, "XlaJitOp", factory);
  }
}

}  // namespace

UcudnnXlaOpRegistrar::UcudnnXlaOpRegistrar(tensorflow::XlaOpRegistrationBuilder&& builder,
                                           tensorflow::XlaOpRegistry::Factory factory) {
  auto registration = builder.Build(factory);  // its type is private to XLA
  const std::string op_name = registration->name;
  const bool late = CompilationKernelsMade();
  tensorflow::XlaOpRegistrar registrar(std::move(registration));
  if (late) RegisterCompilationKernels(op_name, factory);
}

}  // namespace tf_ucudnn
