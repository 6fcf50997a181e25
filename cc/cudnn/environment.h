// The environment variables that steer the cuDNN convolutions, each read once per process since
// every call asks for them.
#ifndef TF_UCUDNN_CC_CUDNN_ENVIRONMENT_H_
#define TF_UCUDNN_CC_CUDNN_ENVIRONMENT_H_

#include <cstddef>

namespace tf_ucudnn {

// TensorFlow's own knob for how much workspace its autotuner may give one convolution
// (TF_CUDNN_WORKSPACE_LIMIT_IN_MB, 4096 by default), in bytes.
size_t AutomaticWorkspaceLimit();

// TF_UCUDNN_LOG_CALLS=1 logs every cuDNN call with its micro-batch, to see a plan execute.
bool LogCalls();

// TF_UCUDNN_RUNTIME_COMPILED_ENGINES=1 lists the engine configurations that compile their kernels
// at run time (nvrtc) too, for profiling: building one takes seconds, in every process that runs
// it and for every micro-batch size, so they are left out unless asked for.
bool RuntimeCompiledEngines();

}  // namespace tf_ucudnn

#endif  // TF_UCUDNN_CC_CUDNN_ENVIRONMENT_H_
