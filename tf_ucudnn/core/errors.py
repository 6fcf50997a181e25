"""The base of every error tf_ucudnn raises on purpose, and errors more than one layer raises.

Each error also keeps the built-in type it has always had (ValueError for a bad argument,
RuntimeError for an environment that cannot do the work), so `except ValueError` still catches
it; `except tf_ucudnn.TfUcudnnError` catches them all.
"""


class TfUcudnnError(Exception):
    """An error of tf_ucudnn's; the message names what failed (a layer, a file, an argument)
    and why."""


class PrefixError(TfUcudnnError, ValueError):
    """A micro-batched prefix the model does not allow; names the layer and the reason."""
