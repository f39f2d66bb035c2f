"""Keras callbacks that track a run from rank 0: ``MLflowLogger`` and ``RemoteTensorBoard``
(``sparktrain._keras.tracking``), as built for this process's Keras; also in ``sparktrain.keras.callbacks``."""
from __future__ import annotations

from .callbacks import MLflowLogger, RemoteTensorBoard  # noqa: F401

__all__ = ["MLflowLogger", "RemoteTensorBoard"]
