"""A run's home: ``<elastic_url>/<run id>/``, where a run keeps what outlives its attempt or its job.

- ``elastic-state.pkl`` (and its manifest): the last ``state.commit()`` of ``hvd.elastic``;
- ``resize-<attempt>``: ``run_elastic``'s driver asks attempt ``<attempt>`` to end at its next
  commit, the reason inside (``sparktrain.tensorflow.resize``);
- ``backup/backup.pkl`` (and its manifest): the Keras-only path's backups
  (``sparktrain.keras.callbacks.BackupAndRestore``);
- ``result.pkl``: rank 0's value, recorded when a named run finished (written whole or not at all);
- ``failed.json``: the last failure's first line, while the run has not finished;
- ``lease.json``: which driver trains the run now (``sparktrain.storage.lease``).

This module alone names these files: the driver (``run``, ``run_elastic``, ``sparktrain runs``) and
the ranks (``sparktrain.storage.rank.home()``) reach them through :class:`Home`. The ``<run id>`` is
the run's name (``run_id=``) where it has one, else its drawn id (``SPARKTRAIN_ELASTIC_ID`` in a rank).
"""
from __future__ import annotations

import json
import re
import time
from typing import Any

from ..errors import InvalidArgumentError, NotFoundError
from . import conditional, lease
from .backends import StorageOptions, filesystem, retry

STATE = "elastic-state.pkl"
#: A resize marker's name, before the attempt's number.
RESIZE = "resize-"
BACKUP = "backup/backup.pkl"
RESULT = "result.pkl"
FAILED = "failed.json"
LEASE = "lease.json"
_RESULT_FORMAT = "sparktrain-result/1"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: Any) -> str:
    """``run_id`` if it can name a run's home, else an error naming the value and the fix.

    >>> check_run_id("sales-2026-11-28")
    'sales-2026-11-28'
    """
    if not isinstance(run_id, str) or not _NAME.fullmatch(run_id) or ".." in run_id:
        raise InvalidArgumentError(
            f"run_id={run_id!r} cannot name a run's home under the elastic_url: use 1 to 128 letters, digits, '.', "
            "'_' or '-', starting with a letter or digit, without '..' or path separators (e.g. 'sales-2026-11-28')")
    return run_id


class Home:
    """The home of the run ``run_id`` under ``elastic_url``."""

    def __init__(self, elastic_url: str, run_id: str, storage_options: StorageOptions = None):
        self.base, self.run_id, self.options = elastic_url.rstrip("/"), run_id, storage_options
        self.url = f"{self.base}/{run_id}"

    def file(self, name: str) -> str:
        return f"{self.url}/{name}"

    def state_url(self) -> str:
        """Where ``hvd.elastic``'s rank 0 writes the state at each ``state.commit()``."""
        return self.file(STATE)

    def backup_url(self) -> str:
        """Where ``BackupAndRestore``'s rank 0 writes its backup at the end of each epoch."""
        return self.file(BACKUP)

    def resize_marker(self, attempt: int | str) -> str:
        """Where ``run_elastic``'s driver asks attempt ``attempt`` to end at its next commit."""
        return self.file(f"{RESIZE}{attempt}")

    # -- the result -------------------------------------------------------------------------------

    def record_result(self, value: Any) -> None:
        """Record rank 0's value: pickled, written beside its place and moved there, then its
        manifest; a reader finds all of it or nothing. Clears the failure record."""
        import cloudpickle

        from .. import storage

        storage.put_bytes(self.file(RESULT), cloudpickle.dumps({"format": _RESULT_FORMAT, "value": value}),
                          self.options, metadata={"finished": time.time()})
        self._remove(FAILED)

    def result(self) -> tuple[bool, Any]:
        """``(True, value)`` when the run finished and recorded its result, else ``(False, None)``."""
        import pickle

        from .. import storage

        try:
            payload = pickle.loads(storage.get_bytes(self.file(RESULT), self.options))
        except NotFoundError:
            return False, None
        if not isinstance(payload, dict) or payload.get("format") != _RESULT_FORMAT:
            raise NotFoundError(f"{self.file(RESULT)} is not a sparktrain result; the elastic_url holds something else")
        return True, payload["value"]

    def finished_at(self) -> float | None:
        from .. import storage

        try:
            return storage.read_manifest(self.file(RESULT), self.options).get("metadata", {}).get("finished")
        except NotFoundError:
            return None

    # -- a failure --------------------------------------------------------------------------------

    def record_failure(self, why: str) -> None:
        fs, path = filesystem(self.file(FAILED), self.options)
        body = json.dumps({"failed": time.time(), "why": why[:500]}).encode()
        retry("writing", self.file(FAILED), self.options, lambda: fs.pipe_file(path, body))

    def failure(self) -> dict | None:
        fs, path = filesystem(self.file(FAILED), self.options)
        try:
            return json.loads(retry("reading", self.file(FAILED), self.options, lambda: fs.cat_file(path)))
        except (NotFoundError, ValueError):
            return None

    # -- the last commit, the lease, the resize markers -------------------------------------------

    def commit(self, data: bytes, epoch: Any = None, batch: Any = None) -> None:
        """Write a ``state.commit()``'s pickled state, atomically; its manifest keeps the epoch and
        batch (integers, else None) for the driver's line about where a next attempt resumes."""
        from .. import storage

        storage.put_bytes(self.state_url(), data, self.options,
                          metadata={"epoch": epoch if isinstance(epoch, int) else None,
                                    "batch": batch if isinstance(batch, int) else None})

    def committed(self) -> bytes | None:
        """The last commit's pickled state, checked against its manifest; None before any commit."""
        from .. import storage

        try:
            return storage.get_bytes(self.state_url(), self.options)
        except NotFoundError:
            return None

    def last_commit(self) -> dict | None:
        """``{"epoch", "batch", "written"}`` of the last ``state.commit()``, or None."""
        from .. import storage

        try:
            manifest = storage.read_manifest(self.state_url(), self.options)
        except NotFoundError:
            return None
        meta = manifest.get("metadata") or {}
        return {"epoch": meta.get("epoch"), "batch": meta.get("batch"), "written": manifest.get("written")}

    def lease(self, seconds: float) -> lease.Lease:
        return lease.Lease(self.file(LEASE), seconds, self.options)

    def lease_record(self) -> dict | None:
        found = conditional.read(self.file(LEASE), self.options)
        return lease.parse(found[0]) if found is not None else None

    def mark_resize(self, attempt: int, why: str) -> None:
        """Ask attempt ``attempt``'s ranks to end at their next commit, for the reason ``why``."""
        from .. import storage

        storage.put_bytes(self.resize_marker(attempt), why.encode(), self.options)

    def resize_asked(self, attempt: int | str) -> str | None:
        """Why the driver asked attempt ``attempt`` to end (its marker's text), or None when it has
        not. Looks at the store itself, not at a listing the filesystem cached; a store it cannot
        reach raises."""
        fs, path = filesystem(self.resize_marker(attempt), self.options)
        fs.invalidate_cache(path.rsplit("/", 1)[0])
        if not fs.exists(path):
            return None
        return fs.cat_file(path).decode(errors="replace")

    def clear_markers(self) -> None:
        """Remove an earlier job's resize markers: a new job numbers its attempts from 1 again."""
        fs, path = filesystem(self.url, self.options)
        fs.invalidate_cache(path)
        try:
            names = fs.ls(path, detail=False)
        except FileNotFoundError:
            return
        for name in names:
            if name.rstrip("/").rsplit("/", 1)[-1].startswith(RESIZE):
                self._remove(name.rstrip("/").rsplit("/", 1)[-1])

    def _remove(self, name: str) -> None:
        fs, path = filesystem(self.file(name), self.options)
        try:
            retry("removing", self.file(name), self.options, lambda: fs.rm(path))
        except NotFoundError:
            pass

    def state(self, now: float | None = None) -> str:
        """``running`` (a live lease), ``finished`` (a recorded result) or ``failed`` (neither:
        its last driver failed, or died)."""
        if lease.live(self.lease_record(), now):
            return "running"
        if self.finished_at() is not None:
            return "finished"
        return "failed"


def run_ids(elastic_url: str, storage_options: StorageOptions = None) -> list[str]:
    """The names of the runs under ``elastic_url`` (every folder there), sorted."""
    fs, path = filesystem(elastic_url, storage_options)
    fs.invalidate_cache(path)
    try:
        entries = retry("listing", elastic_url, storage_options, lambda: fs.ls(path, detail=True))
    except NotFoundError:
        return []
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
