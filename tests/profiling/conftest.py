import os
from pathlib import Path

import pytest

# The measured H100 profiles live beside the checkout (../shared/profiles) or inside it (shared/).
_REPO = Path(__file__).resolve().parents[2]
_CANDIDATES = [Path(os.environ["TF_UCUDNN_PROFILES"])] if "TF_UCUDNN_PROFILES" in os.environ else []
_CANDIDATES += [_REPO.parent / "shared" / "profiles", _REPO / "shared" / "profiles"]


@pytest.fixture(scope="session")
def profiles_dir() -> Path:
    for candidate in _CANDIDATES:
        if (candidate / "h100-cudnn9.14-fp32-nchw.jsonl").exists():
            return candidate
    pytest.skip(f"measured profiles not found in {[str(c) for c in _CANDIDATES]}")
