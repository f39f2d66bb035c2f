"""``import sparktrain.tensorflow.keras as hvd``: Horovod's import path (``horovod.tensorflow.keras``)
for :mod:`sparktrain.keras`. The name is that module itself, not a copy, so a script that imports
either path gets the same objects. The TensorFlow layer does not build on the Keras layer: this
alias is the one import from below to above, and the layer contracts in setup.cfg name it."""
import sys

from .. import keras as _served

sys.modules[__name__] = _served
