"""Measured cuDNN timings: records, JSON-lines files and the per-machine profile database."""

from tf_ucudnn.profiling.database import ProfileDatabase, ProfileDatabaseError
from tf_ucudnn.profiling.records import (
    ALL_SIZES,
    POLICIES,
    POWER_OF_TWO,
    UNDIVIDED,
    AlgorithmTiming,
    ConvGeometry,
    KernelKey,
    KernelTimings,
    ProfileRecord,
    group_by_kernel,
    micro_batch_sizes,
    read_jsonl,
    write_jsonl,
)

__all__ = [
    "ALL_SIZES", "POLICIES", "POWER_OF_TWO", "UNDIVIDED",
    "AlgorithmTiming", "ConvGeometry", "KernelKey", "KernelTimings", "ProfileDatabase",
    "ProfileDatabaseError", "ProfileRecord",
    "group_by_kernel", "micro_batch_sizes", "read_jsonl", "write_jsonl",
]
