"""Ranks' output through storage, for a client the ranks cannot reach (Spark Connect).

With ``run(..., log_url=URL)`` each rank writes its output lines under
``URL/sparktrain-<run id>/`` in numbered pieces, ``rank-<r>-<n>.jsonl``, one at most every
:data:`FLUSH_SECONDS` (object stores have no append); the driver lists the directory every
:data:`POLL_SECONDS` and prints each rank's new pieces in order. A line reaches the notebook
about ``FLUSH_SECONDS + POLL_SECONDS`` after the rank printed it. The pieces stay in storage as
the run's log.
"""
from __future__ import annotations

import json
import posixpath
import threading
import time
from typing import Any, Callable, Mapping

from .backends import filesystem

#: Seconds a rank gathers lines before it writes a piece.
FLUSH_SECONDS = 1.0
#: Seconds between the driver's listings.
POLL_SECONDS = 1.0


def run_dir(url: str, run_id: str) -> str:
    return f"{url.rstrip('/')}/sparktrain-{run_id}"


class RankLog:
    """A rank's side: :meth:`add` lines, :meth:`flush` when due (and at the end)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, run_id: str, rank: int):
        self.fs, root = filesystem(run_dir(url, run_id), storage_options)
        self.fs.makedirs(root, exist_ok=True)
        self.root, self.rank = root, rank
        self.lines: list[str] = []
        self.pieces = 0
        self.flushed = time.monotonic()

    def add(self, stream: str, line: str, at: float) -> None:
        self.lines.append(json.dumps({"s": stream, "l": line, "t": at}))

    def flush(self, force: bool = False) -> None:
        if not self.lines or (not force and time.monotonic() - self.flushed < FLUSH_SECONDS):
            return
        data = ("\n".join(self.lines) + "\n").encode()
        self.lines = []
        self.flushed = time.monotonic()
        self.fs.pipe_file(posixpath.join(self.root, f"rank-{self.rank}-{self.pieces:06d}.jsonl"), data)
        self.pieces += 1


class DriverTail:
    """The driver's side: a thread that prints every rank's pieces as they appear."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, run_id: str,
                 write: Callable[[int, str, str, float], None]):
        self.fs, self.root = filesystem(run_dir(url, run_id), storage_options)
        self.write = write
        self.next: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"sparktrain-log-{run_id}", daemon=True)

    def start(self) -> "DriverTail":
        self._thread.start()
        return self

    def _main(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.sweep()

    def sweep(self) -> None:
        """Print every piece not printed yet, in each rank's order."""
        try:
            names = sorted(posixpath.basename(p) for p in self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return
        for name in names:
            if not (name.startswith("rank-") and name.endswith(".jsonl")):
                continue
            rank, piece = (int(part) for part in name[len("rank-"):-len(".jsonl")].split("-"))
            if piece != self.next.get(rank, 0):
                continue  # printed already, or an earlier piece is not listed yet
            for raw in self.fs.cat_file(posixpath.join(self.root, name)).decode().splitlines():
                entry = json.loads(raw)
                self.write(rank, entry["s"], entry["l"], entry["t"])
            self.next[rank] = piece + 1

    def stop(self) -> None:
        """Stop polling, then print what the ranks wrote last."""
        self._stop.set()
        self._thread.join(30)
        try:
            self.sweep()
            self.sweep()  # a rank's later pieces once its earlier ones were printed
        except Exception:  # noqa: BLE001 - the log must not fail a run that is over
            pass
