"""Output files that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def written_whole(path: str) -> Iterator[str]:
    """A name beside `path` to write to: renamed to `path` when the block ends, removed if the
    block fails, so a reader never sees a half-written file."""
    partial = f"{path}.partial"
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
