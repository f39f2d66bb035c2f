"""Stall reports: which ranks wait in a collective, which have not arrived, and what those are doing.

Every second each rank's task sends, with its beat, the rank's progress as the native engine
records it (``sparktrain.engine.progress``): how many collectives it has begun, whether one runs,
what it is and for how long. :class:`StallWatch` compares the ranks. Once some rank has waited in
collective number *n* for ``stall_warning`` seconds, the ranks that have not begun *n* are late:
the watch asks their tasks for their Python stacks (``faulthandler``, through the channel), and
when every late rank answered, or ``STACKS_SECONDS`` passed, it has a report. Each stall is
reported once; the attempt logs it, and puts the last one into the error of a run that then fails.

Ranks whose collectives do not go through the native engine (NCCL on GPUs, TensorFlow's own ring)
send no progress; a stall among them is not seen here, and ends at the collective timeout.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping

from ...engine import progress

#: How long the watch waits for the late ranks' stacks before it reports without the missing ones.
STACKS_SECONDS = 5.0


@dataclasses.dataclass
class _Stall:
    n: int
    waiting: list[int]
    late: list[int]
    waited: float
    info: dict
    asked: float
    stacks: dict[int, str] = dataclasses.field(default_factory=dict)


class StallWatch:
    """The ranks' progress, compared every tick (``check``) while an attempt runs."""

    def __init__(self, size: int, warning: float, hosts: Mapping[int, str],
                 ask: Callable[[list[int]], None]):
        self.size = size
        self.warning = warning
        self.hosts = hosts
        self._ask = ask
        #: rank -> (progress, monotonic time the collective it is in began, as seen here)
        self._at: dict[int, tuple[dict, float]] = {}
        self._pending: _Stall | None = None
        #: The collectives already reported: n -> when, so each stall is told once. A rank still
        #: in collective n that began before that report is the same stall, not a new one (the
        #: earliest rank may have finished it first); an n that began after it is a new collective.
        self._told: dict[int, float] = {}
        #: The last report made in this attempt; it goes into the error of a run that fails.
        self.last_report: str | None = None

    def progress(self, rank: int, at: dict, now: float) -> None:
        """A rank's beat carried its progress (``age``: seconds its collective has run, on its host)."""
        before = self._at.get(rank)
        began = now - float(at.get("age", 0.0))
        if before is not None and before[0].get("n") == at.get("n") and before[0].get("active") == at.get("active"):
            began = before[1]  # the same collective: keep the first estimate, not the jitter
        self._at[rank] = (at, began)

    def stacks(self, rank: int, text: str) -> None:
        if self._pending is not None and rank in self._pending.late:
            self._pending.stacks[rank] = text

    def check(self, now: float) -> str | None:
        """A new report when one is complete; asks the late ranks for their stacks when a stall begins."""
        if self._pending is not None:
            p = self._pending
            if set(p.stacks) >= set(p.late) or now - p.asked >= STACKS_SECONDS:
                self._pending = None
                self.last_report = self._report(p)
                return self.last_report
            return None
        if not self.warning:
            return None
        active = [(began, r, at) for r, (at, began) in self._at.items() if at.get("active")]
        if not active:
            return None
        began, _, info = min(active, key=lambda a: (a[0], a[1]))
        n = int(info["n"])
        if now - began < self.warning or began <= self._told.get(n, float("-inf")):
            return None
        self._told[n] = now
        waiting = sorted(r for _, r, at in active if int(at["n"]) == n)
        arrived = set(waiting)
        late = sorted(r for r in range(self.size) if r not in arrived and int(self._at.get(r, ({}, 0))[0].get("n", 0)) < n)
        self._pending = _Stall(n, waiting, late, now - began, info, now)
        if late:
            self._ask(late)
        return self.check(now) if not late else None

    def _report(self, p: _Stall) -> str:
        def who(ranks: list[int]) -> str:
            return ", ".join(f"{r} ({self.hosts.get(r, '?')})" for r in ranks)

        plural = len(p.waiting) > 1
        lines = [f"stall: rank{'s' if plural else ''} {who(p.waiting)} {'have' if plural else 'has'} waited "
                 f"{p.waited:.0f} s in {progress.text(p.info)}" +
                 (f"; rank{'s' if len(p.late) > 1 else ''} {', '.join(map(str, p.late))} "
                  f"{'have' if len(p.late) > 1 else 'has'} not arrived" if p.late else "")]
        if not p.late:
            lines.append("  no rank is late: every rank is in this collective, so the wait is in the transport "
                         "between them (a slow or cut link, a stopped host)")
        for r in p.late:
            at = self._at.get(r, ({}, 0.0))[0]
            where = (f"{'in' if at.get('active') else 'after'} {progress.text(at)}" if at.get("n") else
                     "before its first collective")
            lines.append(f"  rank {r} ({self.hosts.get(r, '?')}) is {where}; its Python stack, most recent call first:")
            text = user_frames(p.stacks.get(r, ""))
            if text:
                lines += ["    " + line for line in text.splitlines()]
            else:
                lines.append("    (no stack arrived: the rank's process did not answer SIGUSR1 in time, or it exited)")
        return "\n".join(lines)


def user_frames(text: str) -> str:
    """A rank's ``faulthandler`` dump without the frames of sparktrain's rank process under ``train_fn``."""
    keep = [line for line in text.rstrip().splitlines()
            if "sparktrain/executor/child.py" not in line and "<frozen runpy>" not in line]
    return "\n".join(keep)


def collect_stacks(ranks: list[int], ask: Callable[[list[int]], None], next_stacks: Callable[[float], tuple | None],
                   timeout: float = STACKS_SECONDS) -> dict[int, str]:
    """Ask ``ranks`` for their stacks and gather the answers (``next_stacks`` yields ``(rank, text)``
    pairs as they arrive, None when nothing came within the time given) for up to ``timeout`` s."""
    ask(ranks)
    got: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while set(got) < set(ranks) and time.monotonic() < deadline:
        item = next_stacks(deadline - time.monotonic())
        if item is not None:
            got[item[0]] = item[1]
    return got
