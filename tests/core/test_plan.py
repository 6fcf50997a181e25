"""tf_ucudnn.core.plan: algorithm strings, micro-batch plans, their attributes and JSON."""

import dataclasses
import json

import pytest
import tensorflow as tf

from tf_ucudnn.core.plan import (
    ALGORITHM_COUNTS,
    BACKPROP_FILTER,
    BACKPROP_INPUT,
    DIRECT,
    FORWARD,
    KERNELS,
    MATH_TYPES,
    SPACE_TO_DEPTH,
    SUBSAMPLED,
    Algorithm,
    KernelPlan,
    LayerPlan,
    MicroBatch,
    even_sizes,
)
from tf_ucudnn.kernels.library import op_library


def test_even_sizes_differ_by_one_at_most_the_larger_first():
    assert even_sizes(10, 4) == [3, 3, 2, 2]
    assert even_sizes(8, 4) == [2, 2, 2, 2]
    assert even_sizes(5, 5) == [1] * 5


# ------------------------------------------------------------------------------------ Algorithm

@pytest.mark.parametrize("text, algo, math", [
    ("auto", None, None),
    ("  auto ", None, None),
    ("algo=0", 0, None),
    ("algo=1", 1, None),
    ("algo=7", 7, None),
    ("algo = 3", 3, None),
    ("algo=+2", 2, None),
    ("algo=1,math=tensor_op", 1, "tensor_op"),
    ("math=fma,algo=2", 2, "fma"),
    (" algo=1 , math = default ", 1, "default"),
    ("algo=5,math=tensor_op_allow_conversion", 5, "tensor_op_allow_conversion"),
    ("algo=12", 12, None),  # the range depends on the kernel: checked by the op, not here
], ids=lambda v: repr(v) if isinstance(v, str) else None)
def test_algorithm_parse(text, algo, math):
    parsed = Algorithm.parse(text)
    assert parsed == Algorithm(algo, math)
    assert (parsed.algo, parsed.math) == (algo, math)


@pytest.mark.parametrize("algorithm, text", [
    (Algorithm(), "auto"),
    (Algorithm(1), "algo=1"),
    (Algorithm(0), "algo=0"),
    (Algorithm(1, "tensor_op"), "algo=1,math=tensor_op"),
    (Algorithm(6, "fma"), "algo=6,math=fma"),
], ids=str)
def test_algorithm_format(algorithm, text):
    assert algorithm.to_attr() == text
    assert str(algorithm) == text
    assert Algorithm.parse(text) == algorithm


@pytest.mark.parametrize("math", MATH_TYPES)
@pytest.mark.parametrize("algo", [0, 3])
def test_algorithm_round_trip_every_math_type(algo, math):
    algorithm = Algorithm(algo, math)
    assert Algorithm.parse(algorithm.to_attr()) == algorithm
    assert algorithm.to_attr() == f"algo={algo},math={math}"


@pytest.mark.parametrize("text, reason", [
    ("", "expected 'algo=N[,math=NAME]'"),
    ("algo", "expected 'algo=N[,math=NAME]'"),              # missing '='
    ("algo1", "expected 'algo=N[,math=NAME]'"),             # missing '='
    ("algo=1,", "expected 'algo=N[,math=NAME]'"),           # empty item
    ("algo=1;math=fma", "algo is not an integer"),          # wrong separator
    ("foo=1", "expected 'algo=N[,math=NAME]'"),             # unknown key
    ("algo=1,engine=3", "expected 'algo=N[,math=NAME]'"),   # unknown key
    ("math=fma", "expected 'algo=N[,math=NAME]'"),          # no algo
    ("algo=1,algo=2", "expected 'algo=N[,math=NAME]'"),     # given twice
    ("algo=x", "algo is not an integer"),
    ("algo=1.5", "algo is not an integer"),
    ("algo=", "algo is not an integer"),
    ("algo=1_0", "algo is not an integer"),                 # int() would take it, the op not
    ("algo=-1", "non-negative"),
    ("algo=1,math=bogus", "math must be one of"),
    ("algo=1,math=", "math must be one of"),
    ("AUTO", "expected 'algo=N[,math=NAME]'"),
    ("algo=1,engine=3", "expected 'algo=N[,math=NAME]'"),          # an algo: engine unknown
    ("engine=1,math=fma", "or 'engine=N[,knobs=NAME:V/NAME:V...]'"),  # engines take no math
    ("knobs=A:1", "expected 'algo=N[,math=NAME]'"),                  # no engine
    ("engine=1,engine=2", "expected 'algo=N[,math=NAME]'"),          # given twice
    ("engine=x", "engine is not an integer"),
    ("engine=1_0", "engine is not an integer"),
    ("engine=", "engine is not an integer"),
    ("engine=1,knobs=", "knob '' is not NAME:INTEGER"),
    ("engine=1,knobs=SPLIT_K_SLC", "is not NAME:INTEGER"),
    ("engine=1,knobs=SPLIT_K_SLC:x", "is not NAME:INTEGER"),
    ("engine=1,knobs=SPLIT_K_SLC:2/", "knob '' is not NAME:INTEGER"),
    ("engine=1,knobs=SPLIT_K_SLC:2;TILEK:1", "is not NAME:INTEGER"),
    ("engine=1,knobs=split_k:2", "KnobType_t name"),
    ("engine=1,knobs=A:1/A:2", "given twice"),
    ("engine=-1", "non-negative"),
], ids=repr)
def test_algorithm_parse_rejects(text, reason):
    with pytest.raises(ValueError) as info:
        Algorithm.parse(text)
    assert reason in str(info.value)
    if "cannot parse" in str(info.value):
        assert repr(text.strip()) in str(info.value)


@pytest.mark.parametrize("kwargs, reason", [
    ({"algo": -1}, "non-negative int"),
    ({"algo": 1.0}, "non-negative int"),
    ({"algo": "1"}, "non-negative int"),
    ({"algo": True}, "non-negative int"),
    ({"algo": 1, "math": "tensor"}, "math must be one of"),
    ({"math": "tensor_op"}, "needs an explicit algorithm"),
], ids=lambda v: "-".join(f"{k}={v!r}" for k, v in v.items()) if isinstance(v, dict) else None)
def test_algorithm_rejects(kwargs, reason):
    with pytest.raises(ValueError) as info:
        Algorithm(**kwargs)
    assert reason in str(info.value)


def test_algorithm_is_frozen_and_hashable():
    algorithm = Algorithm(1, "fma")
    with pytest.raises(dataclasses.FrozenInstanceError):
        algorithm.algo = 2
    assert len({Algorithm(1, "fma"), Algorithm.parse("algo=1,math=fma"), Algorithm(1)}) == 2


# ---------------------------------------------------------------- engine configurations

@pytest.mark.parametrize("text, engine, knobs", [
    ("engine=0", 0, ()),
    ("engine=12", 12, ()),
    ("engine=+3", 3, ()),
    ("engine=12,knobs=SPLIT_K_SLC:2", 12, (("SPLIT_K_SLC", 2),)),
    ("engine=12,knobs=TILE_SIZE:5/SPLIT_K_SLC:2", 12, (("SPLIT_K_SLC", 2), ("TILE_SIZE", 5))),
    ("knobs=STAGES:-1,engine=4", 4, (("STAGES", -1),)),
    (" engine = 7 , knobs = TILEK : 1 / EDGE:0 ", 7, (("EDGE", 0), ("TILEK", 1))),
], ids=repr)
def test_engine_config_parse(text, engine, knobs):
    parsed = Algorithm.parse(text)
    assert parsed == Algorithm(engine=engine, knobs=knobs)
    assert (parsed.engine, parsed.knobs, parsed.algo, parsed.math) == (engine, knobs, None, None)
    assert parsed.is_engine


@pytest.mark.parametrize("algorithm, text", [
    (Algorithm(engine=12), "engine=12"),
    (Algorithm(engine=12, knobs={"TILE_SIZE": 5, "SPLIT_K_SLC": 2}),
     "engine=12,knobs=SPLIT_K_SLC:2/TILE_SIZE:5"),
    (Algorithm(engine=0, knobs=[("SWIZZLE", 1)]), "engine=0,knobs=SWIZZLE:1"),
], ids=str)
def test_engine_config_format_is_canonical(algorithm, text):
    assert algorithm.to_attr() == text
    assert str(algorithm) == text
    assert Algorithm.parse(text) == algorithm
    assert not Algorithm(1).is_engine and not Algorithm().is_engine


def test_engine_configs_equal_whatever_the_knob_order():
    one = Algorithm(engine=3, knobs=[("B", 1), ("A", 2)])
    other = Algorithm.parse("engine=3,knobs=A:2/B:1")
    assert one == other and hash(one) == hash(other)
    assert one != Algorithm(engine=3) != Algorithm(3)


@pytest.mark.parametrize("kwargs, reason", [
    ({"engine": -1}, "non-negative int"),
    ({"engine": 1.0}, "non-negative int"),
    ({"engine": True}, "non-negative int"),
    ({"engine": 1, "algo": 1}, "not both"),
    ({"engine": 1, "algo": 1, "math": "fma"}, "not both"),
    ({"knobs": {"SPLIT_K_SLC": 1}}, "knobs need an engine"),
    ({"engine": 1, "knobs": {"SPLIT_K_SLC": 1.5}}, "int value"),
    ({"engine": 1, "knobs": {"SPLIT_K_SLC": True}}, "int value"),
    ({"engine": 1, "knobs": {"": 1}}, "KnobType_t name"),
    ({"engine": 1, "knobs": [("A", 1), ("A", 1)]}, "given twice"),
], ids=lambda v: "-".join(f"{k}={v!r}" for k, v in v.items()) if isinstance(v, dict) else None)
def test_engine_config_rejects(kwargs, reason):
    with pytest.raises(ValueError) as info:
        Algorithm(**kwargs)
    assert reason in str(info.value)


def test_order_key_orders_auto_legacy_then_engines():
    algorithms = [Algorithm(engine=2, knobs={"B": 1}), Algorithm(engine=2), Algorithm(3, "fma"),
                  Algorithm(engine=1), Algorithm(3), Algorithm(), Algorithm(engine=2,
                                                                           knobs={"A": 9})]
    ordered = sorted(algorithms, key=lambda a: a.order_key)
    assert [str(a) for a in ordered] == [
        "auto", "algo=3", "algo=3,math=fma", "engine=1", "engine=2", "engine=2,knobs=A:9",
        "engine=2,knobs=B:1"]


@pytest.mark.parametrize("algorithm, text", [
    (Algorithm(1, form=SUBSAMPLED), "algo=1,subsampled=1"),
    (Algorithm(0, "tensor_op", form=SUBSAMPLED), "algo=0,math=tensor_op,subsampled=1"),
    (Algorithm(engine=4, knobs={"TILEK": 1}, form=SUBSAMPLED),
     "engine=4,knobs=TILEK:1,subsampled=1"),
    (Algorithm(1, form=SPACE_TO_DEPTH), "algo=1,space_to_depth=1"),
    (Algorithm(engine=4, knobs={"TILEK": 1}, form=SPACE_TO_DEPTH),
     "engine=4,knobs=TILEK:1,space_to_depth=1"),
], ids=str)
def test_algorithms_in_other_forms_round_trip(algorithm, text):
    assert algorithm.to_attr() == text
    assert Algorithm.parse(text) == algorithm
    assert Algorithm.parse(text) != dataclasses.replace(algorithm, form=DIRECT)


@pytest.mark.parametrize("text, reason", [
    ("subsampled=1", "subsampled needs an algorithm or engine"),
    ("space_to_depth=1", "space_to_depth needs an algorithm or engine"),
    ("algo=1,subsampled=0", "subsampled must be 1"),
    ("algo=1,subsampled=yes", "subsampled must be 1"),
    ("algo=1,space_to_depth=2", "space_to_depth must be 1"),
    ("algo=1,subsampled=1,space_to_depth=1", "more than one form"),
    ("algo=1,direct=1", "expected"),
], ids=repr)
def test_form_parse_rejects(text, reason):
    with pytest.raises(ValueError, match=reason):
        Algorithm.parse(text)


def test_a_form_needs_an_explicit_algorithm():
    with pytest.raises(ValueError, match="needs an explicit algorithm or engine"):
        Algorithm(form=SUBSAMPLED)
    with pytest.raises(ValueError, match="needs an explicit algorithm or engine"):
        Algorithm(form=SPACE_TO_DEPTH)
    with pytest.raises(ValueError, match="form must be one of"):
        Algorithm(1, form=True)
    assert Algorithm().form == DIRECT and Algorithm(1).form == DIRECT


@pytest.mark.parametrize("form", [SUBSAMPLED, SPACE_TO_DEPTH])
def test_a_kernel_plan_runs_all_its_micro_batches_in_one_form(form):
    both = KernelPlan((MicroBatch(4, Algorithm(1, form=form)),
                       MicroBatch(4, Algorithm(engine=3, form=form))))
    assert both.form == form
    assert KernelPlan.from_json(json.loads(json.dumps(both.to_json()))) == both
    assert KernelPlan.from_attrs(**both.attrs()) == both
    assert KernelPlan.of((4, 1), (4, 0)).form == DIRECT and KernelPlan().form == DIRECT
    with pytest.raises(ValueError, match="run in one form"):
        KernelPlan((MicroBatch(4, Algorithm(1, form=form)), MicroBatch(4, Algorithm(1))))
    with pytest.raises(ValueError, match="run in one form"):
        KernelPlan((MicroBatch(4, Algorithm(1, form=SUBSAMPLED)),
                    MicroBatch(4, Algorithm(1, form=SPACE_TO_DEPTH))))


def test_kernel_plan_carries_engine_configs_in_attrs_json_and_text():
    engine = Algorithm(engine=12, knobs={"TILE_SIZE": 5, "SPLIT_K_SLC": 2})
    plan = KernelPlan((MicroBatch(32, engine, 1 << 20), MicroBatch(32, Algorithm(1))))
    assert plan.attrs()["algorithms"] == ["engine=12,knobs=SPLIT_K_SLC:2/TILE_SIZE:5", "algo=1"]
    assert KernelPlan.from_attrs(**plan.attrs()) == plan
    assert KernelPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert str(plan) == "32@engine=12,knobs=SPLIT_K_SLC:2/TILE_SIZE:5 + 32@algo=1"


def test_plans_written_before_engine_configs_load_unchanged():
    saved = ('{"fwd": [{"size": 2, "algorithm": "algo=1,math=tensor_op"}, '
             '{"size": 3, "algorithm": "auto"}], "bwd_data": [], '
             '"bwd_filter": [{"size": 5, "algorithm": "algo=0", "workspace_bytes": 64}]}')
    plan = LayerPlan.from_json(json.loads(saved))
    assert plan.forward == KernelPlan((MicroBatch(2, Algorithm(1, "tensor_op")), MicroBatch(3)))
    assert plan.backprop_filter.micro_batches[0].algorithm == Algorithm(0)
    assert json.loads(plan.dumps()) == json.loads(saved)


# ------------------------------------------------- the op library reads algorithms like plan.py

# Strings the op library must accept or reject exactly as Algorithm.parse does (for algorithm
# numbers in range of every kernel).
_SHARED_SYNTAX = ["auto", " auto", "algo=0", "algo=2,math=fma", "math=tensor_op,algo=1",
                  " algo = 1 , math = default ", "algo=+1", "", "algo", "algo1", "foo=1",
                  "algo=1,", "algo=x", "algo=1_0", "algo=1.5", "algo=1,math=bogus", "math=fma",
                  "algo=1,algo=1", "AUTO",
                  # graph-API engine configurations
                  "engine=0", "engine=12,knobs=SPLIT_K_SLC:2/TILE_SIZE:5", "knobs=A:1,engine=4",
                  " engine = 7 , knobs = TILEK : 1 / EDGE:0 ", "engine=+3", "algo=1,engine=3",
                  "engine=1,math=fma", "engine=x", "engine=1_0", "engine=", "knobs=A:1",
                  "engine=1,knobs=", "engine=1,knobs=A", "engine=1,knobs=A:x",
                  "engine=1,knobs=A:1/", "engine=1,knobs=a:1", "engine=1,knobs=A:1/A:2",
                  "engine=-1", "engine=1,engine=1",
                  # subsampled runs
                  "algo=1,subsampled=1", "subsampled=1,engine=2,knobs=A:1",
                  "algo=0,math=fma,subsampled=1", "subsampled=1", "algo=1,subsampled=0",
                  "algo=1,subsampled=true", "algo=1,subsampled=1,subsampled=1", "auto,subsampled=1",
                  "engine=2,subsampled=",
                  # runs in space-to-depth blocks
                  "algo=1,space_to_depth=1", "space_to_depth=1,engine=2,knobs=A:1",
                  "space_to_depth=1", "algo=1,space_to_depth=0", "algo=1,space_to_depth=1,"
                  "subsampled=1", "auto,space_to_depth=1", "algo=1,direct=1"]


@pytest.mark.parametrize("text", _SHARED_SYNTAX, ids=repr)
def test_op_library_agrees_with_plan_parser(text):
    try:
        Algorithm.parse(text)
        python_accepts = True
    except ValueError:
        python_accepts = False
    x = tf.zeros([2, 4, 4, 1])
    # A strided 1x1 convolution may run subsampled, a strided 3x3 one in space-to-depth blocks.
    w = tf.zeros([3, 3, 1, 1] if "space_to_depth" in text else [1, 1, 1, 1])
    with tf.device("/CPU:0"):
        try:
            op_library().ucudnn_conv2d(x, w, strides=[1, 2, 2, 1], padding="VALID",
                                       micro_batches=[2], algorithms=[text])
            op_accepts = True
        except tf.errors.InvalidArgumentError as error:
            op_accepts = False
            assert "cannot parse algorithm" in error.message
    assert op_accepts == python_accepts


@pytest.mark.parametrize("kernel", KERNELS)
def test_algorithm_counts_match_op_library(kernel):
    """plan.ALGORITHM_COUNTS is the op library's range: the last number passes, the next not."""
    count = ALGORITHM_COUNTS[kernel]
    x = tf.zeros([2, 3, 3, 1])
    w = tf.zeros([1, 1, 1, 1])
    dy = tf.zeros([2, 3, 3, 1])
    attrs = {"strides": [1, 1, 1, 1], "padding": "VALID", "micro_batches": [2]}

    def run(algo):
        text = Algorithm(algo).to_attr()
        with tf.device("/CPU:0"):
            if kernel == FORWARD:
                return op_library().ucudnn_conv2d(x, w, algorithms=[text], **attrs)
            if kernel == BACKPROP_INPUT:
                return op_library().ucudnn_conv2d_backprop_input([2, 3, 3, 1], w, dy, algorithms=[text],
                                                         **attrs)
            return op_library().ucudnn_conv2d_backprop_filter(x, [1, 1, 1, 1], dy, algorithms=[text],
                                                      **attrs)

    assert run(count - 1).shape.rank == 4
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        run(count)
    assert f"algorithm {count} is not a" in info.value.message
    assert f"(0..{count - 1})" in info.value.message


# ----------------------------------------------------------------------------------- MicroBatch

def test_micro_batch_defaults_to_auto():
    assert MicroBatch(3).algorithm == Algorithm()
    assert MicroBatch(3, Algorithm(1)).algorithm.algo == 1


@pytest.mark.parametrize("size", [0, -1, 2.0, "2", None, True], ids=repr)
def test_micro_batch_rejects_size(size):
    with pytest.raises(ValueError, match="micro-batch size must be a positive int"):
        MicroBatch(size)


# ----------------------------------------------------------------------------------- KernelPlan

def test_kernel_plan_of():
    plan = KernelPlan.of((3, 1), (5, 0), (2, None))
    assert plan.sizes == (3, 5, 2)
    assert plan.batch_size == 10
    assert [mb.algorithm for mb in plan.micro_batches] == [Algorithm(1), Algorithm(0), Algorithm()]
    assert isinstance(plan.micro_batches, tuple)
    assert KernelPlan([MicroBatch(2)]) == KernelPlan((MicroBatch(2),))  # lists become tuples


def test_empty_kernel_plan_is_auto():
    plan = KernelPlan()
    assert plan.sizes == ()
    assert plan.batch_size is None
    assert plan.attrs() == {"micro_batches": [], "algorithms": []}
    assert plan.to_json() == []
    assert "undivided" in str(plan)


@pytest.mark.parametrize("batch, micro, sizes", [
    (8, 4, (4, 4)),
    (8, 3, (3, 3, 2)),
    (7, 2, (2, 2, 2, 1)),
    (5, 8, (5,)),
    (5, 1, (1, 1, 1, 1, 1)),
    (0, 3, ()),
], ids=lambda v: str(v) if not isinstance(v, tuple) else "+".join(map(str, v)) or "empty")
def test_kernel_plan_uniform(batch, micro, sizes):
    plan = KernelPlan.uniform(batch, micro, Algorithm(1))
    assert plan.sizes == sizes
    assert all(mb.algorithm == Algorithm(1) for mb in plan.micro_batches)
    if sizes:
        assert plan.batch_size == batch


@pytest.mark.parametrize("batch, micro, reason", [
    (8, 0, "micro-batch size must be positive"),
    (8, -2, "micro-batch size must be positive"),
    (-5, 2, "batch size must not be negative"),
])
def test_kernel_plan_uniform_rejects(batch, micro, reason):
    with pytest.raises(ValueError, match=reason):
        KernelPlan.uniform(batch, micro)


def test_kernel_plan_attrs_and_from_attrs():
    plan = KernelPlan((MicroBatch(2, Algorithm(1, "tensor_op")), MicroBatch(3),
                       MicroBatch(1, Algorithm(0))))
    attrs = plan.attrs()
    assert attrs == {"micro_batches": [2, 3, 1],
                     "algorithms": ["algo=1,math=tensor_op", "auto", "algo=0"]}
    assert KernelPlan.from_attrs(**attrs) == plan
    # Graph attributes come back as bytes.
    assert KernelPlan.from_attrs(attrs["micro_batches"],
                                 [a.encode() for a in attrs["algorithms"]]) == plan


def test_kernel_plan_from_attrs_rejects_length_mismatch():
    with pytest.raises(ValueError, match="2 micro-batches but 1 algorithms"):
        KernelPlan.from_attrs([2, 3], ["auto"])


@pytest.mark.parametrize("sizes, algorithms, error", [
    ([0], ["auto"], "micro-batch size"),
    ([-2], ["auto"], "micro-batch size"),
    ([2], ["algo=x"], "algo is not an integer"),
    ([2], ["algo=-1"], "non-negative"),
], ids=["zero", "negative", "non-integer", "negative-algo"])
def test_kernel_plan_from_attrs_validates(sizes, algorithms, error):
    with pytest.raises(ValueError, match=error):
        KernelPlan.from_attrs(sizes, algorithms)


def test_kernel_plan_str():
    assert str(KernelPlan.of((2, 1), (3, None))) == "2@algo=1 + 3@auto"


@pytest.mark.parametrize("plan", [
    KernelPlan(),
    KernelPlan.of((8, None)),
    KernelPlan.of((2, 1), (3, 0)),
    KernelPlan.of((1, 4), (4, 1), (2, None)),
    KernelPlan((MicroBatch(3, Algorithm(2, "fma")), MicroBatch(1, Algorithm(0, "default")))),
], ids=lambda p: str(p).replace(" ", "") or "auto")
def test_kernel_plan_json_round_trip(plan):
    data = json.loads(json.dumps(plan.to_json()))
    assert KernelPlan.from_json(data) == plan
    assert all(set(item) == {"size", "algorithm"} for item in data)
    assert [item["size"] for item in data] == list(plan.sizes)


def test_kernel_plan_from_json_validates():
    with pytest.raises(ValueError, match="cannot parse algorithm"):
        KernelPlan.from_json([{"size": 2, "algorithm": "algo"}])
    with pytest.raises(ValueError, match="micro-batch size"):
        KernelPlan.from_json([{"size": 0, "algorithm": "auto"}])
    with pytest.raises(KeyError):
        KernelPlan.from_json([{"size": 2}])


# ------------------------------------------------------------------------------------ LayerPlan

def _layer_plan():
    return LayerPlan(forward=KernelPlan.of((2, 1), (3, 0)),
                     backprop_input=KernelPlan.of((5, 1)),
                     backprop_filter=KernelPlan((MicroBatch(1, Algorithm(3, "tensor_op")),
                                                 MicroBatch(4))))


def test_layer_plan_kernels():
    plan = _layer_plan()
    assert plan.kernel(FORWARD) is plan.forward
    assert plan.kernel(BACKPROP_INPUT) is plan.backprop_input
    assert plan.kernel(BACKPROP_FILTER) is plan.backprop_filter
    with pytest.raises(KeyError):
        plan.kernel("forward")
    assert KERNELS == ("fwd", "bwd_data", "bwd_filter")
    assert LayerPlan() == LayerPlan(KernelPlan(), KernelPlan(), KernelPlan())


def test_layer_plan_json_round_trip():
    plan = _layer_plan()
    data = json.loads(plan.dumps())
    assert set(data) == set(KERNELS)
    assert data["fwd"] == [{"size": 2, "algorithm": "algo=1"}, {"size": 3, "algorithm": "algo=0"}]
    assert data["bwd_filter"][0] == {"size": 1, "algorithm": "algo=3,math=tensor_op"}
    assert LayerPlan.from_json(data) == plan
    assert LayerPlan.from_json(json.loads(LayerPlan().dumps())) == LayerPlan()


def test_layer_plan_from_json_missing_kernels_are_auto():
    plan = LayerPlan.from_json({"bwd_data": [{"size": 4, "algorithm": "algo=1"}]})
    assert plan.forward == KernelPlan()
    assert plan.backprop_input == KernelPlan.of((4, 1))
    assert plan.backprop_filter == KernelPlan()


def test_a_plans_workspace_travels_in_json_and_does_not_change_what_it_runs():
    profiled = KernelPlan((MicroBatch(8, Algorithm(1), 3000), MicroBatch(8, Algorithm(0), 5000)))
    bare = KernelPlan.of((8, 1), (8, 0))
    assert profiled == bare and profiled.attrs() == bare.attrs()
    assert profiled.workspace_bytes == 5000 and bare.workspace_bytes is None
    again = KernelPlan.from_json(json.loads(json.dumps(profiled.to_json())))
    assert [mb.workspace_bytes for mb in again.micro_batches] == [3000, 5000]
    assert bare.to_json() == [{"size": 8, "algorithm": "algo=1"},
                              {"size": 8, "algorithm": "algo=0"}]
