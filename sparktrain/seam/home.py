"""The run's home as a rank reaches it: the ``storage_options`` of ``run(..., storage_options=)``.

The driver reads and writes the home (``<elastic_url>/<run id>/``) with them; it hands them to
every rank in its task spec, and the task writes them to ``home.pkl`` in the rank's private work
directory (never to the environment, which other processes of the user can read). The rank's
process loads them as it starts (``executor.child``), and its commits (``hvd.elastic`` states),
Keras backups (``BackupAndRestore`` in the home) and resize markers use them. Without them, or
outside a rank, the store's credentials come from the process's environment.
"""
from __future__ import annotations

import os
from typing import Any

#: The file in a rank's work directory that holds the pickled options.
FILE = "home.pkl"

_options: dict[str, Any] | None = None


def load(workdir: str) -> None:
    """Read this rank's home options from ``workdir``, where its task wrote them (if it did)."""
    global _options
    path = os.path.join(workdir, FILE)
    if os.path.exists(path):
        import cloudpickle

        with open(path, "rb") as f:
            _options = cloudpickle.load(f)


def options() -> dict[str, Any] | None:
    """The storage options for the run's home on this rank; None: the environment's credentials."""
    return _options
