"""``import sparktrain.tensorflow.keras as hvd``: Horovod's import path (``horovod.tensorflow.keras``)
for :mod:`sparktrain.keras`. The name is that module itself, not a copy, so a script that imports
either path gets the same objects. Only that import loads it: nothing in ``sparktrain.tensorflow``
imports this alias, and the layer contracts in setup.cfg name its one import as the alias it is."""
import sys

from .. import keras as _served

sys.modules[__name__] = _served
