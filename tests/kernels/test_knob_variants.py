"""The engine listing's knob variants (cc/cudnn/knob_variants.cc) on the CPU: which values of a
knob's range are tried, and which configurations one knob away from each engine's first are added
to cuDNN's heuristics', in what order and up to what limit. tests/kernels/knob_variants_check.cc,
built here with g++, prints them for fixed cases."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPECTED = [
    "values 0 2 1: 0 1 2",                      # few values: all of them
    "values 0 7 1: 0 1 2 3 4 5 6 7",
    "values 1 1000 1: 1 2 4 16 32 128 256 1000",  # many: the ends and powers of two, 8 spread
    "values 1 100 3: 1 4 16 64 100",            # powers of two on the stride only
    "values -1 64 1: -1 1 2 4 8 16 32 64",
    "values 5 5 1: 5",
    "values 0 4 0:",                            # ranges that hold no value
    "values 3 2 1:",
    # Engines in turn; a variant equal to a heuristics' configuration (68 at WORKSPACE 0) is not
    # added again; the other knobs keep the first configuration's values.
    "variants all: 30,2:5,12:1,17:21 30,2:5,12:2,17:21 68,2:1,22:1 30,2:5,12:3,17:21 "
    "30,2:5,12:20,17:2 30,2:5,12:20,17:4",
    "variants limit3: 30,2:5,12:1,17:21 30,2:5,12:2,17:21 68,2:1,22:1",
    "variants none:",
]


def test_the_knob_variants_added_to_the_heuristics(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the knob variants' check")
    binary = tmp_path / "knob_variants_check"
    sources = [os.path.join(REPO, "tests", "kernels", "knob_variants_check.cc"),
               os.path.join(REPO, "cc", "cudnn", "knob_variants.cc")]
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{REPO}", *sources,
                    "-o", str(binary)], check=True, capture_output=True, timeout=300)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert [line.rstrip() for line in result.stdout.splitlines()] == EXPECTED
