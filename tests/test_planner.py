"""planner: layers planned from measured profiles, as the rewrite pass uses them."""

import pytest
import tensorflow as tf

from tf_ucudnn import models
from tf_ucudnn.graph.conv_layers import find_conv_layers, trace_model
from tf_ucudnn.graph.rewrite import rewrite
from tf_ucudnn.planner import DatabasePlanner
from tf_ucudnn.profiling import ProfileDatabase
from tf_ucudnn.profiling.profiler import Machine

H100 = Machine("NVIDIA H100 80GB HBM3", 91400)
MIB = 1 << 20


@pytest.fixture
def database(profiles_dir, tmp_path):
    with ProfileDatabase(tmp_path / "profiles.sqlite") as db:
        db.import_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl", H100.device,
                        H100.cudnn_version)
        yield db


@pytest.fixture(scope="module")
def alexnet_layers():
    layers, skipped = find_conv_layers(trace_model(models.alexnet("channels_first"), 256))
    assert skipped == []
    return layers


def test_micro_batches_where_they_pay_and_the_best_algorithm_elsewhere(database,
                                                                      alexnet_layers):
    planner = DatabasePlanner(database, 64 * MIB, machine=H100)
    conv1, conv2 = alexnet_layers[0], alexnet_layers[1]
    undivided = planner(conv1)  # every kernel of conv1 is best undivided, with a named algorithm
    assert [plan.sizes for plan in (undivided.forward, undivided.backprop_input,
                                    undivided.backprop_filter)] == [(256,)] * 3
    assert all(plan.micro_batches[0].algorithm.algo is not None
               for plan in (undivided.forward, undivided.backprop_input, undivided.backprop_filter))
    assert DatabasePlanner(database, 64 * MIB, machine=H100,
                           leave_undivided_to_tensorflow=True)(conv1).startswith("no gain")
    plan = planner(conv2)
    assert [mb.size for mb in plan.forward.micro_batches] == [32] * 8
    assert {mb.algorithm.algo for mb in plan.forward.micro_batches} == {1}


def test_missing_profiles_are_named(database, alexnet_layers):
    planner = DatabasePlanner(database, 64 * MIB, machine=Machine("Some GPU", 90000))
    reason = planner(alexnet_layers[1])
    assert "no profile" in reason and "Some GPU" in reason


def test_rewrite_with_the_planner(database):
    model = models.alexnet("channels_first")
    concrete = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec([256, 3, 227, 227]))
    _, report = rewrite(concrete, DatabasePlanner(database, 64 * MIB, machine=H100,
                                                  leave_undivided_to_tensorflow=True))
    assert len(report.layers) == 4
    assert len(report.left_alone) == 1 and report.left_alone[0].reason.startswith("no gain")
