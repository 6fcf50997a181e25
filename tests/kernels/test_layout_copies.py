"""The cuDNN kernels' layouts (cc/cudnn/layout.cc) on the CPU: tests/kernels/layout_copies_check.cc,
built here with g++ against the layout, copies each case's tensors to cuDNN's view as the layout
says (on the host, as the copies' description says and through the GPU copy kernel's own
per-element code, which must agree) and checks that a naive convolution of that view is the naive
convolution of the op's tensors, forward and both gradients copied back: inputs in space-to-depth
blocks, subsampled, padded for asymmetric padding, transposed for float64 channels-last and in the
channels-first form, in both layouts, and that XLA's order for the filter operand
(FilterMinorToMajor) lays it out as cuDNN's copy. It also runs random copies of every rank (3-D
convolutions copy rank 5) through the kernel's code against the description, and checks its
division by multiply and shift against integer division.
Wrong strides, bounds, block order or kernel index arithmetic show as WRONG lines."""

import os
import shutil
import subprocess

import pytest
import tensorflow as tf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_include():
    """CUDA's headers (the copy's declaration names cudaStream_t), as setup.py finds them."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    return None


def test_the_layouts_copies_give_the_convolution_of_the_ops_tensors(tmp_path):
    include = _cuda_include()
    if shutil.which("g++") is None or include is None:
        pytest.skip("needs g++ and CUDA's headers (cuda_runtime.h) to build the layout")
    binary = tmp_path / "layout_copies_check"
    sources = [os.path.join(REPO, "tests", "kernels", "layout_copies_check.cc"),
               os.path.join(REPO, "cc", "cudnn", "layout.cc")]
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{REPO}", f"-I{tf.sysconfig.get_include()}",
                    f"-I{include}", *sources, "-o", str(binary)],
                   check=True, capture_output=True, timeout=600)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[-1] == "all cases right", result.stdout
    cases = lines[:-1]
    assert len(cases) == 48 and all(line.endswith(" ok") for line in cases)
    assert {line.split()[0] for line in cases} == {"space_to_depth", "subsampled", "direct",
                                                   "channels_first"}
    assert {line.split()[1] for line in cases} == {"NCHW", "NHWC"}
