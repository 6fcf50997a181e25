# The native sources, read by BUILD (Bazel) and setup.py (pip) alike: the op library's, then the
# planner's own Python extension's.

# Built everywhere: the ops, the CPU kernels and the XLA kernels.
COMMON_SOURCES = [
    "cc/batch_norm/batch_norm_cpu.cc",
    "cc/batch_norm/batch_norm_ops.cc",
    "cc/batch_norm/batch_norm_xla.cc",
    "cc/common/conv_geometry.cc",
    "cc/common/micro_batch_plan.cc",
    "cc/conv/conv_cpu.cc",
    "cc/conv/conv_ops.cc",
    "cc/conv/conv_xla.cc",
    "cc/conv/self_check.cc",
    "cc/fused_conv/fused_conv_cpu.cc",
    "cc/fused_conv/fused_conv_ops.cc",
    "cc/profile/profile_ops.cc",
    "cc/xla/xla_registration.cc",
]

# Built where CUDA and cuDNN are found: the cuDNN kernels and the XLA custom call.
GPU_SOURCES = [
    "cc/batch_norm/batch_norm_gpu.cc",
    "cc/conv/conv_custom_call_gpu.cc",
    "cc/conv/conv_gpu.cc",
    "cc/cudnn/convolution.cc",
    "cc/cudnn/convolution_algorithm.cc",
    "cc/cudnn/convolution_profile.cc",
    "cc/cudnn/cudnn_support.cc",
    "cc/cudnn/engines.cc",
    "cc/cudnn/environment.cc",
    "cc/cudnn/knob_variants.cc",
    "cc/cudnn/layout.cc",
    "cc/cudnn/types.cc",
    "cc/fused_conv/cudnn_fused_convolution.cc",
    "cc/fused_conv/fused_conv_gpu.cc",
    "cc/profile/profile_gpu.cc",
]

# Compiled by nvcc.
CUDA_SOURCES = [
    "cc/cudnn/accumulate.cu.cc",
    "cc/cudnn/strided_copy.cu.cc",
]

# The memory planner's step simulator, compiled: a Python extension of its own (pybind11), with
# no TensorFlow in it.
STEP_SIMULATOR_SOURCES = [
    "cc/memory/step_simulator.cc",
]
