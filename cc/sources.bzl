# The op library's sources, read by BUILD (Bazel) and setup.py (pip) alike.

# Built everywhere: the ops, the CPU kernels and the XLA kernels.
COMMON_SOURCES = [
    "cc/ops/batch_norm_ops.cc",
    "cc/ops/conv_ops.cc",
    "cc/ops/profile_ops.cc",
    "cc/kernels/batch_norm_cpu.cc",
    "cc/kernels/batch_norm_xla.cc",
    "cc/kernels/conv_cpu.cc",
    "cc/kernels/conv_geometry.cc",
    "cc/kernels/conv_xla.cc",
    "cc/kernels/micro_batch_plan.cc",
    "cc/kernels/xla_registration.cc",
]

# Built where CUDA and cuDNN are found: the cuDNN kernels and the XLA custom call.
GPU_SOURCES = [
    "cc/kernels/batch_norm_gpu.cc",
    "cc/kernels/conv_custom_call_gpu.cc",
    "cc/kernels/conv_gpu.cc",
    "cc/kernels/cudnn_support.cc",
    "cc/kernels/profile_gpu.cc",
]

# Compiled by nvcc.
CUDA_SOURCES = [
    "cc/kernels/strided_copy.cu.cc",
]
