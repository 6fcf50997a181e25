"""Builds tf_ucudnn's op library against the TensorFlow installed in this environment.

TensorFlow custom ops must be compiled against the exact TensorFlow they load into, so install
with `pip install --no-build-isolation .`: an isolated build environment would compile against
another copy of TensorFlow than the one you run.

The memory planner's step simulator (cc/memory/step_simulator.cc) is a Python extension of its
own, built with pybind11 where it is installed: without it the build says so and leaves it out,
and the planner predicts with numpy alone, slower.

The cuDNN kernels are compiled when a CUDA toolkit (nvcc) and cuDNN headers and library are found:
in $CUDA_HOME / $CUDNN_HOME, the system paths, or the nvidia-* wheels that `tensorflow[and-cuda]`
installs. Set TF_UCUDNN_CPU_ONLY=1 to build the CPU kernels alone.

cuDNN's graph-API engine configurations (cc/cudnn/engines.cc) also need NVIDIA's header-only
cudnn-frontend (and nvrtc.h, which it includes): from $CUDNN_FRONTEND_INCLUDE, or the
nvidia-cudnn-frontend wheel (`pip install 'tf_ucudnn[gpu]'`, which puts them in site-packages'
include/). Without them the legacy algorithms build and run as before and engine configurations
fail when run. The headers are not vendored: 3 MB, and the wheel can be carried to a machine
without a package index.
"""

import ast
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _source_lists():
    """COMMON_SOURCES, GPU_SOURCES, CUDA_SOURCES and STEP_SIMULATOR_SOURCES from cc/sources.bzl,
    which BUILD loads too."""
    lists = {}
    with open(os.path.join(HERE, "cc", "sources.bzl")) as source:
        for statement in ast.parse(source.read()).body:
            if isinstance(statement, ast.Assign):
                lists[statement.targets[0].id] = ast.literal_eval(statement.value)
    return (lists["COMMON_SOURCES"], lists["GPU_SOURCES"], lists["CUDA_SOURCES"],
            lists["STEP_SIMULATOR_SOURCES"])


COMMON_SOURCES, GPU_SOURCES, CUDA_SOURCES, STEP_SIMULATOR_SOURCES = _source_lists()
OP_LIBRARY = "tf_ucudnn._ucudnn_ops"
STEP_SIMULATOR = "tf_ucudnn._step_simulator"
DEFAULT_CUDA_ARCHS = "75;80;86;89;90"


def _tensorflow_flags():
    try:
        import tensorflow as tf
    except ImportError:
        sys.exit("tf_ucudnn: TensorFlow must be importable while building, because the ops are "
                 "compiled against it. Install tensorflow first, then run "
                 "`pip install --no-build-isolation .`")
    # The XLA kernels include XLA's headers, which include two libraries TensorFlow ships under
    # include/external, and link against libtensorflow_cc, which exports XLA's op registry.
    external = os.path.join(tf.sysconfig.get_include(), "external")
    compile_flags = [*tf.sysconfig.get_compile_flags(),
                     f"-I{os.path.join(external, 'highwayhash')}",
                     f"-I{os.path.join(external, 'farmhash_archive', 'src')}"]
    return compile_flags, [*tf.sysconfig.get_link_flags(), "-l:libtensorflow_cc.so.2"]


def _site_packages_dirs():
    """Where this Python imports packages from (site-packages, and PYTHONPATH's folders), so that
    NVIDIA's wheels are found wherever they were installed for it."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path]
    return [p for p in dict.fromkeys(dirs) if p and os.path.isdir(p)]


def _find_cuda():
    """Returns (nvcc, include dirs, library dirs) for CUDA and cuDNN, or a reason they are missing."""
    if os.environ.get("TF_UCUDNN_CPU_ONLY") == "1":
        return None, "TF_UCUDNN_CPU_ONLY=1"
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = next((os.path.join(h, "bin", "nvcc") for h in homes
                 if h and os.path.exists(os.path.join(h, "bin", "nvcc"))), shutil.which("nvcc"))
    if not nvcc:
        return None, "no nvcc (set CUDA_HOME)"
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    wheel_roots = [os.path.join(p, "nvidia", "cudnn") for p in _site_packages_dirs()]
    cudnn_roots = [os.environ.get("CUDNN_HOME"), cuda_home, "/usr", *wheel_roots]
    header_dirs = [d for r in cudnn_roots if r
                   for d in (os.path.join(r, "include"), os.path.join(r, "include", "x86_64-linux-gnu"))
                   if os.path.exists(os.path.join(d, "cudnn.h"))]
    if not header_dirs:
        return None, f"no cudnn.h (looked under {[r for r in cudnn_roots if r]}; set CUDNN_HOME)"
    library_dirs = [d for r in cudnn_roots if r
                    for d in (os.path.join(r, "lib64"), os.path.join(r, "lib"),
                              os.path.join(r, "lib", "x86_64-linux-gnu"))
                    if glob.glob(os.path.join(d, "libcudnn.so*"))]
    if not library_dirs:
        return None, "cudnn.h found but no libcudnn.so (set CUDNN_HOME)"
    cuda_lib = next(d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib"))
                    if os.path.isdir(d))
    return {"nvcc": nvcc, "include_dirs": [os.path.join(cuda_home, "include"), *header_dirs],
            "library_dirs": [cuda_lib, *library_dirs]}, None


def _find_cudnn_frontend(cuda_include_dirs, cuda_library_dirs):
    """(include dirs, link flags) for cudnn_frontend.h and the nvrtc it uses, or a reason they
    are missing."""
    roots = [os.environ.get("CUDNN_FRONTEND_INCLUDE"),
             *(os.path.join(p, "include") for p in _site_packages_dirs())]
    frontend = next((r for r in roots
                     if r and os.path.exists(os.path.join(r, "cudnn_frontend.h"))), None)
    if not frontend:
        return None, ("no cudnn_frontend.h (set CUDNN_FRONTEND_INCLUDE or install "
                      "nvidia-cudnn-frontend)")
    # nvidia-cuda-nvrtc's wheels: nvidia/cuda_nvrtc for CUDA 12, nvidia/cu13 for CUDA 13.
    nvrtc_homes = [os.path.join(p, "nvidia", home) for p in _site_packages_dirs()
                   for home in ("cuda_nvrtc", "cu13")]
    include_dirs = [*cuda_include_dirs, *(os.path.join(h, "include") for h in nvrtc_homes)]
    library_dirs = [*cuda_library_dirs, *(os.path.join(h, "lib") for h in nvrtc_homes)]
    nvrtc = next((d for d in include_dirs if os.path.exists(os.path.join(d, "nvrtc.h"))), None)
    nvrtc_lib = next((d for d in library_dirs if glob.glob(os.path.join(d, "libnvrtc.so*"))), None)
    if not nvrtc or not nvrtc_lib:
        return None, f"cudnn_frontend.h in {frontend} but no nvrtc (install nvidia-cuda-nvrtc)"
    # The frontend compiles some kernels at run time with nvrtc.
    versioned = sorted(glob.glob(os.path.join(nvrtc_lib, "libnvrtc.so.*")))
    library = "-lnvrtc" if os.path.exists(os.path.join(nvrtc_lib, "libnvrtc.so")) \
        else "-l:" + os.path.basename(versioned[0])
    return {"include_dirs": [frontend, nvrtc],
            "link_flags": [f"-L{nvrtc_lib}", f"-Wl,-rpath,{nvrtc_lib}", library]}, None


def _cudnn_link_flag(library_dirs):
    # pip's cuDNN wheels ship only the versioned name; TensorFlow loads that same library.
    for d in library_dirs:
        if os.path.exists(os.path.join(d, "libcudnn.so")):
            return "-lcudnn"
    versioned = sorted(glob.glob(os.path.join(library_dirs[0], "libcudnn.so.*")))
    return "-l:" + os.path.basename(versioned[0])


def _object_path(objects_dir, src):
    # Mirrors cc/'s folders: two op families may each have a source of the same name.
    obj = os.path.join(objects_dir, src + ".o")
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    return obj


def _pybind11_include():
    """pybind11's headers, or None where pybind11 is not installed (a build without isolation
    sees only what the environment has)."""
    try:
        import pybind11
    except ImportError:
        return None
    return pybind11.get_include()


class BuildOpsAndSimulator(build_ext):
    """Compiles the op library with the system compiler and TensorFlow's own flags, and the step
    simulator with pybind11's."""

    def run(self):
        if _pybind11_include() is None:
            print("tf_ucudnn: the compiled step simulator left out: pybind11 is not installed "
                  "(`pip install pybind11`, then build again); the memory planner predicts with "
                  "numpy alone, slower")
            self.extensions = [e for e in self.extensions if e.name != STEP_SIMULATOR]
        super().run()

    def build_extension(self, ext):
        if ext.name == STEP_SIMULATOR:
            self._build_step_simulator(ext)
        else:
            self._build_op_library(ext)

    def _build_step_simulator(self, ext):
        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        # No contraction of a * b + c into one rounding: the times must be numpy's, bit for bit.
        command = [os.environ.get("CXX", "g++"), "-O3", "-fPIC", "-std=c++17", "-shared",
                   "-ffp-contract=off", "-fvisibility=hidden", "-I", _pybind11_include(),
                   "-I", sysconfig.get_paths()["include"], *ext.sources, "-o", output]
        result = self._run(command)
        if result.returncode:
            sys.exit(f"tf_ucudnn: compiling failed:\n{' '.join(command)}\n{result.stderr}")

    def _build_op_library(self, ext):
        compile_flags, link_flags = _tensorflow_flags()
        cuda, missing = _find_cuda()
        objects_dir = os.path.join(self.build_temp, "tf_ucudnn_ops")
        os.makedirs(objects_dir, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        base = [cxx, "-O2", "-fPIC", "-std=c++17", "-I", HERE, *compile_flags,
                "-Wno-sign-compare", "-Wno-unused-function", "-Wno-deprecated-declarations"]
        commands, objects = [], []
        sources = list(COMMON_SOURCES)
        if cuda:
            base += ["-DGOOGLE_CUDA=1", *(f"-I{d}" for d in cuda["include_dirs"])]
            sources += GPU_SOURCES
            frontend, frontend_missing = _find_cudnn_frontend(cuda["include_dirs"],
                                                              cuda["library_dirs"])
            if frontend:
                base += ["-DTF_UCUDNN_CUDNN_FRONTEND=1",
                         *(f"-I{d}" for d in frontend["include_dirs"])]
                print("tf_ucudnn: cuDNN engine configurations through cudnn-frontend in "
                      f"{frontend['include_dirs'][0]}")
            else:
                print(f"tf_ucudnn: cuDNN engine configurations left out: {frontend_missing}")
            archs = os.environ.get("TF_UCUDNN_CUDA_ARCHS", DEFAULT_CUDA_ARCHS).split(";")
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
            gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
            for src in CUDA_SOURCES:
                obj = _object_path(objects_dir, src)
                commands.append([cuda["nvcc"], "-O2", "-std=c++17", "-x", "cu", "-I", HERE,
                                 "-Xcompiler", "-fPIC", *gencode, "-c", src, "-o", obj])
                objects.append(obj)
            print("tf_ucudnn: building the CPU and cuDNN kernels "
                  f"(nvcc {cuda['nvcc']}, cuDNN from {cuda['include_dirs'][1]})")
        else:
            print(f"tf_ucudnn: building the CPU kernels only; GPU kernels skipped: {missing}")
        for src in sources:
            obj = _object_path(objects_dir, src)
            commands.append([*base, "-c", src, "-o", obj])
            objects.append(obj)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for command, result in zip(commands, pool.map(self._run, commands)):
                if result.returncode:
                    sys.exit(f"tf_ucudnn: compiling failed:\n{' '.join(command)}\n{result.stderr}")
        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        link = [cxx, "-shared", "-o", output, *objects, *link_flags]
        if cuda:
            link += [*(f"-L{d}" for d in cuda["library_dirs"]),
                     *(f"-Wl,-rpath,{d}" for d in cuda["library_dirs"][1:]),
                     "-lcudart_static", _cudnn_link_flag(cuda["library_dirs"][1:]),
                     "-ldl", "-lrt", "-lpthread", *(frontend["link_flags"] if frontend else [])]
        result = self._run(link)
        if result.returncode:
            sys.exit(f"tf_ucudnn: linking failed:\n{' '.join(link)}\n{result.stderr}")

    @staticmethod
    def _run(command):
        return subprocess.run(command, cwd=HERE, capture_output=True, text=True)


setup(
    ext_modules=[Extension(OP_LIBRARY, sources=COMMON_SOURCES),
                 Extension(STEP_SIMULATOR, sources=STEP_SIMULATOR_SOURCES)],
    cmdclass={"build_ext": BuildOpsAndSimulator},
)
