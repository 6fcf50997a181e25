"""Importing tf_ucudnn where its op library is missing or cannot be loaded: the import works, and
load_ops() and the ops raise LibraryNotBuilt saying how to build it. Each case imports a copy of
the package, without the built library or with a file that is no library, in a fresh process."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK = textwrap.dedent("""
    import tensorflow as tf
    import tf_ucudnn
    from tf_ucudnn.kernels.library import LibraryNotBuilt
    print(tf_ucudnn.__file__)
    for use in (tf_ucudnn.load_ops,
                lambda: tf_ucudnn.conv2d(tf.ones([1, 4, 4, 1]), tf.ones([3, 3, 1, 1]), strides=1,
                                         padding="SAME")):
        try:
            use()
        except LibraryNotBuilt as error:
            print(error)
        else:
            print("no error")
""")


@pytest.mark.parametrize("library, message", [
    (None, "op library is not built"),
    (b"not a shared library", "op library cannot be loaded"),
], ids=["not_built", "not_loadable"])
def test_import_works_and_the_ops_say_how_to_build_the_library(tmp_path, library, message):
    shutil.copytree(os.path.join(REPO, "tf_ucudnn"), tmp_path / "tf_ucudnn",
                    ignore=shutil.ignore_patterns("_ucudnn_ops*", "__pycache__"))
    if library is not None:
        (tmp_path / "tf_ucudnn" / "_ucudnn_ops.so").write_bytes(library)
    # The copy, not this checkout's nor the one an editable install may point at.
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    imported, *errors = result.stdout.splitlines()
    assert imported == str(tmp_path / "tf_ucudnn" / "__init__.py")
    assert len(errors) == 2
    for error in errors:
        assert message in error and "pip install --no-build-isolation -e ." in error
