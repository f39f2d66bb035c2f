"""Where the tensor collectives run, chosen once per ``init()`` (``runtime.state.backend``).

- ``single``: one rank; every collective is the identity.
- ``kernels``: the native engine, through sparktrain's TensorFlow kernels (no Python per call).
- ``numpy``: the native engine, through one ``tf.numpy_function`` per call (``hostops``): where
  the kernels could not be built, ``SPARKTRAIN_TF_KERNELS=0``, and for Adasum.
- ``ring``: TensorFlow's own collective ops (``ringops``): its ring on CPU, NCCL on GPU.

Each backend runs the bare collective: no scaling, no gradient, no argument checks; those are
the same on every backend and live in ``collectives``.
"""
from __future__ import annotations

from .base import Backend, fused, in_graph, in_order  # noqa: F401 - the collectives order and fuse with them too

NAMES = ("single", "kernels", "numpy", "ring")
_made: dict[str, Backend] = {}


def get(name: str) -> Backend:
    """The backend called ``name`` (one of :data:`NAMES`); made once per process."""
    backend = _made.get(name)
    if backend is None:
        if name == "single":
            from .single import Single as cls
        elif name == "kernels":
            from .native import Kernels as cls
        elif name == "numpy":
            from .native import Numpy as cls
        elif name == "ring":
            from .ring import Ring as cls
        else:
            raise ValueError(f"no collective backend {name!r}; one of {', '.join(NAMES)}")
        backend = _made[name] = cls()
    return backend
