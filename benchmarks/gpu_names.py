"""The GPUs a benchmark runs on, by the names its results record."""
import platform

import tensorflow as tf


def gpu_names() -> list:
    """Each GPU TensorFlow sees, by its device name ("NVIDIA H200", ...)."""
    return [tf.config.experimental.get_device_details(gpu).get("device_name", "GPU")
            for gpu in tf.config.list_physical_devices("GPU")]


def device_name() -> str:
    """The first GPU's name, or the CPU's where there is no GPU."""
    return next(iter(gpu_names()), None) or platform.processor() or "CPU"
