"""Measured cuDNN timings: records, JSON-lines files and the per-machine profile database, with
the measured H100 and H200 profiles packaged (`packaged_profiles()`); and what a traced TensorFlow
step did, from the profiler's XSpace (`step_trace`)."""

from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.profiling.database import ProfileDatabase, ProfileDatabaseError
from tf_ucudnn.profiling.records import (
    ALL_SIZES,
    POLICIES,
    POWER_OF_TWO,
    UNDIVIDED,
    AlgorithmTiming,
    KernelKey,
    KernelTimings,
    ProfileFileError,
    ProfileRecord,
    group_by_kernel,
    micro_batch_sizes,
    packaged_profiles,
    read_jsonl,
    write_jsonl,
)
from tf_ucudnn.profiling.step_trace import (
    GpuEvent,
    Span,
    alive_at_peak,
    cross_device_copies,
    device_timeline,
    gpu_events,
    gpu_timeline,
    measured_op_ms,
    op_spans,
    read_profile,
)

__all__ = [
    "ALL_SIZES", "POLICIES", "POWER_OF_TWO", "UNDIVIDED",
    "AlgorithmTiming", "ConvGeometry", "GpuEvent", "KernelKey", "KernelTimings",
    "ProfileDatabase", "ProfileDatabaseError", "ProfileFileError", "ProfileRecord", "Span",
    "alive_at_peak", "cross_device_copies", "device_timeline", "gpu_events", "gpu_timeline",
    "group_by_kernel", "measured_op_ms", "micro_batch_sizes", "op_spans", "packaged_profiles",
    "read_jsonl", "read_profile", "write_jsonl",
]
