"""A rank's directories on the executor's disk, and the sweep that removes those of dead tasks.

A rank's work directory, and its DataFrame spool, are made by its barrier task and removed by
that task when the rank ends, or by the rank's watcher (watcher.py) if the task dies. When every
process of a host dies at once (its machine stopped, its container killed), no watcher is left:
the directories stay on that host's disk, with the run's collective key and payload in them. The
next rank that starts on the host, of any run, removes them.

Whose directory is dead is told by a lock, never by a pid (pids are reused): the task that makes a
directory holds an exclusive ``flock`` on its ``.owner`` file for as long as the directory is in
use, and the kernel releases the lock when that task exits, whatever killed it. ``.owner`` gets
its name only once it is locked, so a sweep never sees it unlocked while its maker lives. A
directory without ``.owner``, of another user, or whose name is not a rank's, is left alone.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from typing import Iterable

#: The lock file in each directory a task makes.
OWNER = ".owner"
#: What a rank's work directory holds besides: the task writes the payload (cloudpickled
#: ``(train_fn, args, kwargs)``) and, for rank 0 with ``checkpoint_url``, that URL; the rank's process
#: leaves rank 0's pickled value or its failure (``sparktrain.storage.rank`` names the options' file).
PAYLOAD = "payload.pkl"
CHECKPOINT_URL = "checkpoint-url"
VALUE = "value.pkl"
ERROR = "error.json"
#: The names of rank directories: ``sparktrain-<run id>-r<rank>-...`` (the spool's too).
_NAME = re.compile(r"sparktrain-.+-r\d+-")


class OwnedDir:
    """A directory this process made and holds (see the module's doc); :meth:`close` removes it."""

    def __init__(self, prefix: str, parent: str | None = None):
        self.path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        staged = os.path.join(self.path, OWNER + ".new")
        self._fd: int | None = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(staged, os.path.join(self.path, OWNER))

    def close(self) -> None:
        """Remove the directory, then let go of its lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sweep(parents: Iterable[str | None]) -> list[str]:
    """Remove the rank directories under ``parents`` (None: the system's temp directory) whose
    task is gone; returns the removed paths."""
    removed = []
    for parent in dict.fromkeys(p or tempfile.gettempdir() for p in parents):
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            if _NAME.match(entry.name) and entry.is_dir(follow_symlinks=False) and _remove_if_dead(entry.path):
                removed.append(entry.path)
    return removed


def _remove_if_dead(path: str) -> bool:
    try:
        if os.lstat(path).st_uid != os.geteuid():
            return False
        fd = os.open(os.path.join(path, OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: not a directory this sweep can judge
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its task holds it
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.exists(path)
    finally:
        os.close(fd)
