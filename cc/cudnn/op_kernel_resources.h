// A GPU op kernel's ConvResources: TensorFlow's stream, and its temporaries for the workspace and
// the layout copies, so TensorFlow's allocator accounts for them. Kept apart from
// conv_resources.h so that the cuDNN sources need no TensorFlow kernel headers.
#ifndef TF_UCUDNN_CC_CUDNN_OP_KERNEL_RESOURCES_H_
#define TF_UCUDNN_CC_CUDNN_OP_KERNEL_RESOURCES_H_

#define EIGEN_USE_GPU

#include <cstdint>
#include <list>
#include <string>

#include "absl/strings/str_cat.h"
#include "cc/cudnn/conv_resources.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_ucudnn {

class OpKernelResources : public ConvResources {
 public:
  explicit OpKernelResources(tensorflow::OpKernelContext* ctx) : ctx_(ctx) {}

  cudaStream_t stream() override { return ctx_->eigen_gpu_device().stream(); }

  absl::Status Allocate(size_t bytes, void** memory) override {
    temporaries_.emplace_back();
    TF_RETURN_IF_ERROR(ctx_->allocate_temp(
        tensorflow::DT_UINT8, tensorflow::TensorShape({static_cast<int64_t>(bytes)}),
        &temporaries_.back()));
    *memory = temporaries_.back().flat<uint8_t>().data();
    return absl::OkStatus();
  }

  std::string label() const override {
    return absl::StrCat(ctx_->op_kernel().type_string(), " '", ctx_->op_kernel().name(), "'");
  }

 private:
  tensorflow::OpKernelContext* ctx_;
  std::list<tensorflow::Tensor> temporaries_;
};

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_OP_KERNEL_RESOURCES_H_
