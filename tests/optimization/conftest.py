import os
from pathlib import Path

import pytest

from tf_ucudnn.profiling import group_by_kernel, read_jsonl

# The measured H100 profiles live beside the checkout (../shared/profiles) or inside it (shared/).
_REPO = Path(__file__).resolve().parents[2]
_CANDIDATES = [Path(os.environ["TF_UCUDNN_PROFILES"])] if "TF_UCUDNN_PROFILES" in os.environ else []
_CANDIDATES += [_REPO.parent / "shared" / "profiles", _REPO / "shared" / "profiles"]


@pytest.fixture(scope="session")
def fp32_tables() -> dict:
    """(layer, kernel) -> timing table of the measured fp32 NCHW profiles, in file order."""
    for candidate in _CANDIDATES:
        path = candidate / "h100-cudnn9.14-fp32-nchw.jsonl"
        if path.exists():
            records = read_jsonl(path)
            layers = {r.geometry: r.layer for r in records}
            return {(layers[key.geometry], key.kernel): table
                    for key, table in group_by_kernel(records).items()}
    pytest.skip(f"measured profiles not found in {[str(c) for c in _CANDIDATES]}")
