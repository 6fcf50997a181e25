// Reading convolution and plan attributes, the same way from an OpKernelConstruction (kernels) and
// an InferenceContext (shape functions).
#ifndef TF_UCUDNN_CC_CONV_CONV_ATTRS_H_
#define TF_UCUDNN_CC_CONV_CONV_ATTRS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/common/conv_geometry.h"
#include "cc/common/micro_batch_plan.h"

namespace tf_ucudnn {

// Attribute names of the plan of each kernel. A forward op carries all three: its own, and those
// its gradient gives to the backprop ops.
struct PlanAttrNames {
  const char* micro_batches;
  const char* algorithms;
};
inline PlanAttrNames OwnPlanAttrs() { return {"micro_batches", "algorithms"}; }
inline PlanAttrNames BackpropInputPlanAttrs() {
  return {"backprop_input_micro_batches", "backprop_input_algorithms"};
}
inline PlanAttrNames BackpropFilterPlanAttrs() {
  return {"backprop_filter_micro_batches", "backprop_filter_algorithms"};
}

template <typename Context>
absl::Status ReadConvAttrs(Context* context, int num_spatial_dims, ConvAttrs* attrs) {
  std::string data_format, padding;
  std::vector<int64_t> strides, dilations, explicit_paddings;
  auto ok = [](const auto& s) { return absl::Status(s); };
  absl::Status status = ok(context->GetAttr("data_format", &data_format));
  if (status.ok()) status = ok(context->GetAttr("padding", &padding));
  if (status.ok()) status = ok(context->GetAttr("strides", &strides));
  if (status.ok()) status = ok(context->GetAttr("dilations", &dilations));
  if (status.ok()) status = ok(context->GetAttr("explicit_paddings", &explicit_paddings));
  if (!status.ok()) return status;
  return ConvAttrs::Parse(num_spatial_dims, data_format, padding, strides, dilations,
                          explicit_paddings, attrs);
}

template <typename Context>
absl::Status ReadPlanAttrs(Context* context, ConvKernel kernel, PlanAttrNames names,
                           MicroBatchPlan* plan) {
  std::vector<int64_t> sizes;
  std::vector<std::string> algorithms;
  absl::Status status(context->GetAttr(names.micro_batches, &sizes));
  if (status.ok()) status = absl::Status(context->GetAttr(names.algorithms, &algorithms));
  if (!status.ok()) return status;
  status = MicroBatchPlan::FromAttrs(kernel, sizes, algorithms, plan);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("plan ", names.micro_batches, "=[",
                                                   absl::StrJoin(sizes, ", "), "] ",
                                                   names.algorithms, "=['",
                                                   absl::StrJoin(algorithms, "', '"),
                                                   "'] is invalid: ", status.message()));
  }
  return absl::OkStatus();
}

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CONV_CONV_ATTRS_H_
