"""profiler: cuDNN measurements through the UcudnnProfileConvolution op."""

import pytest
import tensorflow as tf

from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import ALGORITHM_COUNTS, KERNELS
from tf_ucudnn.kernels.library import gpu_kernels_available
from tf_ucudnn.profiling import ProfileDatabase, profiler

GEOMETRY = ConvGeometry(in_channels=8, out_channels=16, input_dims=(12, 12), filter_dims=(3, 3),
                        pads=(1, 1), strides=(1, 1), dilations=(1, 1), dtype="float32",
                        layout="NCHW")


def _gpu_reason():
    if not gpu_kernels_available():
        return "tf_ucudnn was built without its cuDNN kernels"
    if not tf.config.list_physical_devices("GPU"):
        return "no GPU visible to TensorFlow"
    return None


def test_without_cudnn_kernels_profiling_says_why():
    if gpu_kernels_available():
        pytest.skip("this build has the cuDNN kernels")
    with pytest.raises(profiler.ProfilerUnavailable, match="without its cuDNN kernels"):
        profiler.current_machine()


@pytest.fixture
def machine():
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    return profiler.current_machine()


@pytest.mark.gpu
def test_machine_names_the_gpu_and_cudnn(machine):
    assert machine.device and machine.device != "GPU"
    assert machine.cudnn_version >= 8000


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_measures_algorithms_at_each_size(machine, kernel):
    records = profiler.measure(GEOMETRY, kernel, [8, 3, 1], machine)
    assert {r.batch_size for r in records} == {8, 3, 1}
    for record in records:
        assert record.kernel == kernel and record.geometry == GEOMETRY
        assert 0 <= record.algo < ALGORITHM_COUNTS[kernel]
        assert record.time_ms > 0 and record.workspace_bytes >= 0
    # cuDNN's Find runs several algorithms for a plain 3x3 convolution.
    assert len({r.algo for r in records if r.batch_size == 8}) >= 2


@pytest.mark.gpu
def test_asymmetric_and_nhwc_geometries_run(machine):
    geometry = ConvGeometry(in_channels=3, out_channels=4, input_dims=(10, 11), filter_dims=(3, 3),
                            pads=(0, 1), strides=(2, 1), dilations=(1, 2), dtype="float16",
                            layout="NHWC")
    records = profiler.measure(geometry, "fwd", [4], machine)
    assert records and all(r.geometry.layout == "NHWC" for r in records)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_and_depthwise_geometries_run(machine, kernel):
    for groups in (2, 16):  # 16: depthwise, one input channel per group
        geometry = ConvGeometry(in_channels=16, out_channels=32, input_dims=(12, 12),
                                filter_dims=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1),
                                dtype="float32", layout="NHWC", groups=groups)
        records = profiler.measure(geometry, kernel, [4, 2], machine)
        assert {r.batch_size for r in records} == {4, 2}
        assert all(r.geometry.groups == groups and r.time_ms > 0 for r in records)


@pytest.mark.gpu
def test_profile_measures_once_per_machine(machine, tmp_path):
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        added = profiler.profile([(GEOMETRY, "test.conv")], 4, database, progress=False)
        assert added > 0
        for kernel in KERNELS:
            table = database.timings(machine.device, machine.cudnn_version, GEOMETRY, kernel)
            assert set(table) == {1, 2, 4}
        assert profiler.profile([(GEOMETRY, "test.conv")], 4, database, progress=False) == 0
