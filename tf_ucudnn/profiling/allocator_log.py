"""What TensorFlow's BFC allocator logs when it runs out of memory, read back: the request, and
how the allocator's memory was split at that moment.

A step can run out of memory two ways: it needs more than the cap, or the cap's free memory is
split into chunks smaller than the request (fragmentation: more than the request is free in all,
but no one chunk holds it).
A memory plan can answer the first; the second needs fewer large tensors. The dump is logged at
TensorFlow's default log level (TF_CPP_MIN_LOG_LEVEL unset or 0).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

_REQUEST = re.compile(r"Allocator \((?P<allocator>[^)]+)\) ran out of memory trying to allocate "
                      r"\S+ \(rounded to (?P<bytes>\d+)\)\s*requested by op (?P<op>\S+)")
_CHUNK = re.compile(r"\] (?P<state>InUse|Free) +at [0-9a-f]+ of size (?P<bytes>\d+)")
_END = "Sum Total of in-use chunks"


@dataclasses.dataclass(frozen=True)
class OutOfMemoryReport:
    """One out-of-memory failure: the allocator, the request and the op that made it, and the
    bytes in use, free, and in the largest free chunk, from the allocator's map of its memory."""

    allocator: str
    requested_bytes: int
    op: str
    in_use_bytes: int
    free_bytes: int
    largest_free_bytes: int

    @property
    def fragmented(self) -> bool:
        """Enough memory was free, but in no chunk large enough."""
        return self.free_bytes >= self.requested_bytes > self.largest_free_bytes

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "fragmented": self.fragmented}


def out_of_memory_report(log: str) -> Optional[OutOfMemoryReport]:
    """The first out-of-memory dump in `log` (TensorFlow's standard error), or None if it has
    none or the dump has no map of the allocator's chunks (a log level above 0)."""
    request = _REQUEST.search(log)
    if request is None:
        return None
    dump = log[request.end():]
    dump = dump[:dump.find(_END)] if _END in dump else dump
    chunks = [(match["state"], int(match["bytes"])) for match in _CHUNK.finditer(dump)]
    if not chunks:
        return None
    free = [size for state, size in chunks if state == "Free"]
    return OutOfMemoryReport(
        allocator=request["allocator"], requested_bytes=int(request["bytes"]), op=request["op"],
        in_use_bytes=sum(size for state, size in chunks if state == "InUse"),
        free_bytes=sum(free), largest_free_bytes=max(free, default=0))
