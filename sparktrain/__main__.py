"""``python -m sparktrain``, and ``spark-submit .../sparktrain/__main__.py``: see sparktrain.cli."""
import os
import sys

if not __package__:
    # Started as a file, as spark-submit starts Python (it takes files, not modules). Python put
    # this package's own directory first on sys.path, where sparktrain/keras and
    # sparktrain/tensorflow would shadow the real keras and tensorflow.
    _here = os.path.realpath(os.path.dirname(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _here]

from sparktrain.cli import main

sys.exit(main())
