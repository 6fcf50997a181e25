"""The op library (loaded on first use), its Python wrappers and gradients. Importing the package
registers the gradients, which need no library."""

from tf_ucudnn.kernels import fused_conv, gradients

__all__ = ["fused_conv", "gradients"]
