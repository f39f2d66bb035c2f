"""The run's storage as a rank reaches it: ``run(..., storage_options=)``, loaded once, and the run's home.

The driver pickles the run's ``storage_options`` once (``driver.launch.config``) into the task spec
(``TaskSpec.storage_options``); each rank's task writes them to :data:`FILE` in the rank's private
work directory (never to the environment, which other processes of the user can read), and the
rank's process loads them once as it starts (``executor.child``, where a value it cannot unpickle is
reported as such). From then on everything on the rank that reaches storage for the run reads
:func:`options`: the home's commits, backups and resize markers (:func:`home`), rank 0's
``checkpoint_url`` upload, and the files of a fed Parquet or ORC scan (``sparktrain.data``).
Without them, or outside a rank, the store's credentials come from the process's environment.
"""
from __future__ import annotations

import os
from typing import Any

from ..seam import worker_env
from ..settings import rank as rank_settings
from .home import Home

#: The file in a rank's work directory that holds the pickled options.
FILE = "storage-options.pkl"
#: What :func:`load` read, as ``settings.rank`` keeps the rank's settings: set by it alone.
_loaded: dict[str, Any] | None = None


def write(workdir: str, pickled: bytes | None) -> None:
    """The task's part: put the spec's pickled options where the rank's process loads them."""
    if pickled is not None:
        with open(os.path.join(workdir, FILE), "wb") as f:
            f.write(pickled)


def load(workdir: str) -> None:
    """Read this rank's storage options from ``workdir``, where its task wrote them (if it did).
    Unpickling may raise (an object of a module this executor lacks): the caller reports it."""
    global _loaded
    path = os.path.join(workdir, FILE)
    if os.path.exists(path):
        import cloudpickle

        with open(path, "rb") as f:
            _loaded = cloudpickle.load(f)


def options() -> dict[str, Any] | None:
    """The run's storage options on this rank; None: the environment's credentials."""
    return _loaded


def home() -> Home | None:
    """This rank's view of the run's home (``<elastic_url>/<elastic id>/``, with the run's storage
    options), or None without the ``elastic_url`` setting."""
    url = rank_settings.current().elastic_url
    if not url:
        return None
    return Home(url, worker_env.elastic_id(os.environ), options())


def attempt() -> str | None:
    """``run_elastic``'s attempt number in this rank (its resize marker's), or None outside ``run_elastic``."""
    return os.environ.get(worker_env.ELASTIC_ATTEMPT) or None
