"""Reading the BFC allocator's out-of-memory dump back: a real one, from an H200 run."""

import os

from tf_ucudnn.profiling.allocator_log import out_of_memory_report

DATA = os.path.join(os.path.dirname(__file__), os.pardir, "data")


def test_a_real_dump_reads_as_fragmentation():
    # ResNet-50 at batch 768 under a 16 GiB cap (benchmarks/results/
    # beyond_memory_h200_resnet50_768_allocator.json): 9.16 GiB in use, 2.38 GiB asked for.
    with open(os.path.join(DATA, "bfc_out_of_memory.log")) as log:
        report = out_of_memory_report(log.read())
    assert report.allocator == "GPU_0_bfc"
    assert report.requested_bytes == 2555117568
    assert report.op == "ucudnn/gradient_tape/resnet50_1/pool1_pool_1/MaxPool2d/MaxPoolGrad"
    assert report.in_use_bytes + report.free_bytes == 16 << 30  # the one region: the cap
    assert abs(report.in_use_bytes / 2**30 - 9.16) < 0.01
    assert report.largest_free_bytes == 2377383936  # the 2.21 GiB chunk
    assert report.fragmented
    assert report.to_json()["fragmented"] is True


def test_a_request_over_the_free_memory_is_not_fragmentation():
    log = ("W0000 bfc_allocator.cc:502] Allocator (GPU_0_bfc) ran out of memory trying to "
           "allocate 3.00GiB (rounded to 3221225472)requested by op conv\n"
           "I0000 bfc_allocator.cc:1105] InUse at 7f00 of size 3221225472 next 1\n"
           "I0000 bfc_allocator.cc:1105] Free  at 7f01 of size 1073741824 next 2\n"
           "I0000 bfc_allocator.cc:1105] Free  at 7f02 of size 536870912 next 3\n"
           "I0000 bfc_allocator.cc:1117] Sum Total of in-use chunks: 3.00GiB\n"
           "I0000 bfc_allocator.cc:1105] Free  at 7f03 of size 9999999999 next 4\n")
    report = out_of_memory_report(log)
    assert (report.in_use_bytes, report.free_bytes, report.largest_free_bytes) == (
        3221225472, 1610612736, 1073741824)  # what follows the dump is not read
    assert not report.fragmented


def test_a_log_without_a_dump_gives_none():
    assert out_of_memory_report("OOM when allocating tensor with shape[768,114,114,64]") is None
    assert out_of_memory_report(
        "Allocator (GPU_0_bfc) ran out of memory trying to allocate 1.00GiB (rounded to "
        "1073741824)requested by op x\n") is None  # logged above level 0: no chunk map
