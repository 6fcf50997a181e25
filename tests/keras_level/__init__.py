"""Tests of tf_ucudnn.keras (the folder is not named keras, which would shadow Keras itself)."""
