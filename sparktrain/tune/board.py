"""What the user sees of a study: its running trials, their last reports, and the best trial so far.

Rendered for where the driver's output goes, as a run's display is (``driver.show.display.sink_kind``):

- **a Jupyter cell**: one table updated in place: each running trial's number, params, last step
  and value, ranks and elapsed time; the trials that ended, with their state; the best so far;
- **a terminal** or **a file**: one line per trial event (started, complete, pruned, failed).

The trials' own output (rank 0's lines, as ``run`` shows them) reaches the same stream, each line
after ``[trial N]``: :meth:`Board.stream` is the ``stdout`` each trial's run is given.
"""
from __future__ import annotations

import html
import sys
import threading
import time
from typing import IO, Any

from ..driver.face import sink_kind

#: Seconds between two redraws of the Jupyter table for reports alone (a state change redraws at once).
REDRAW_SECONDS = 1.0


class _Row:
    def __init__(self, number: int, num_proc: int):
        self.number = number
        self.num_proc = num_proc
        self.params: dict[str, Any] = {}
        self.step: int | None = None
        self.value: float | None = None
        self.state = "RUNNING"
        self.started = time.monotonic()
        self.ended: float | None = None

    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started


class TrialLines:
    """A trial's ``stdout``: each line it writes goes to the board's stream after ``[trial N]``."""

    def __init__(self, board: Board, number: int):
        self._board, self._number, self._partial = board, number, ""

    def write(self, text: str) -> int:
        text = self._partial + text
        *lines, self._partial = text.split("\n")
        for line in lines:
            self._board.line(f"[trial {self._number}] {line}")
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class Board:
    """The study's status as trials start, report and end (see the module's doc). Thread-safe."""

    def __init__(self, stdout: IO[str] | None, study_name: str, direction: str):
        self.out = stdout or sys.stdout
        self.kind = sink_kind(self.out)
        self.study_name, self.direction = study_name, direction
        self.rows: dict[int, _Row] = {}
        self.best: tuple[int, Any] | None = None
        self._lock = threading.Lock()
        self._handle = None
        self._drawn = 0.0

    def stream(self, number: int) -> TrialLines:
        return TrialLines(self, number)

    def line(self, text: str) -> None:
        with self._lock:
            self.out.write(text + "\n")
            self.out.flush()

    # -- events ----------------------------------------------------------------------------------------
    def started(self, number: int, num_proc: int, params: dict[str, Any]) -> None:
        with self._lock:
            row = self.rows[number] = _Row(number, num_proc)
            row.params = dict(params)
        if self.kind != "jupyter":
            fixed = f" with {_params(params)}" if params else ""
            self.line(f"sparktrain: tune: trial {number} started on {num_proc} rank(s){fixed}")
        self._draw(force=True)

    def params(self, number: int, params: dict[str, Any]) -> None:
        with self._lock:
            row = self.rows.get(number)
            if row is not None:
                row.params = dict(params)
        self._draw()

    def reported(self, number: int, step: int, value: float) -> None:
        with self._lock:
            row = self.rows.get(number)
            if row is not None:
                row.step, row.value = step, value
        self._draw()

    def ended(self, number: int, state: str, params: dict[str, Any], value: Any = None, message: str = "",
              best: tuple[int, Any] | None = None) -> None:
        with self._lock:
            row = self.rows.get(number)
            if row is not None:
                row.state, row.ended, row.params = state, time.monotonic(), dict(params)
                if state == "COMPLETE":
                    row.value = value
            if best is not None:
                self.best = best
            seconds = row.elapsed() if row is not None else 0.0
        if self.kind != "jupyter":
            what = {"COMPLETE": f"complete, value {_value(value)}", "PRUNED": "pruned", "FAIL": "failed"}[state]
            why = f": {message}" if message and state != "COMPLETE" else ""
            best_text = f"; best so far: trial {best[0]}, value {_value(best[1])}" if best is not None else ""
            self.line(f"sparktrain: tune: trial {number} {what} after {seconds:.1f} s with {_params(params)}"
                      f"{why}{best_text}")
        self._draw(force=True)

    # -- the Jupyter table ---------------------------------------------------------------------------
    def _draw(self, force: bool = False) -> None:
        if self.kind != "jupyter":
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._drawn < REDRAW_SECONDS:
                return
            self._drawn = now
            bundle = {"text/html": self.html(), "text/plain": self.text()}
        from IPython.display import display

        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    _HEAD = ("trial", "state", "params", "step", "value", "ranks", "elapsed")

    def _cells(self) -> list[tuple]:
        """The table's rows as they stand, running trials first (callers hold the lock)."""
        return [(row.number, row.state.lower(), _params(row.params), "" if row.step is None else row.step,
                 _value(row.value), row.num_proc, f"{row.elapsed():.0f} s")
                for row in sorted(self.rows.values(), key=lambda r: (r.state != "RUNNING", -r.number))]

    def _title(self) -> str:
        best = (f"best so far: trial {self.best[0]}, value {_value(self.best[1])}"
                if self.best is not None else "no trial complete yet")
        running = sum(r.state == "RUNNING" for r in self.rows.values())
        return (f"sparktrain.tune: study {self.study_name} ({self.direction}), {running} running, "
                f"{len(self.rows) - running} ended; {best}")

    def html(self) -> str:
        """The table as it stands, for the cell (callers hold the lock)."""
        head = "".join(f"<th>{h}</th>" for h in self._HEAD)
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
                       for cells in self._cells())
        return (f"<div class='sparktrain-tune'>{html.escape(self._title())}<table><thead><tr>{head}</tr></thead>"
                f"<tbody>{rows}</tbody></table></div>")

    def text(self) -> str:
        """The table as text: what a front end without HTML shows (callers hold the lock)."""
        lines = [self._title(), " | ".join(self._HEAD)]
        lines += [" | ".join(str(c) for c in cells) for cells in self._cells()]
        return "\n".join(lines)


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in params.items()) or "no params"


def _value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    return str(v)
