import pytest

from tf_ucudnn.profiling import group_by_kernel, read_jsonl


@pytest.fixture(scope="session")
def fp32_tables(profiles_dir) -> dict:
    """(layer, kernel) -> timing table of the measured fp32 NCHW profiles, in file order."""
    records = read_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")
    layers = {r.geometry: r.layer for r in records}
    return {(layers[key.geometry], key.kernel): table
            for key, table in group_by_kernel(records).items()}
