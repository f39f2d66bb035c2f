"""What the user sees of a run: the ranks' lines, the progress bar being drawn, the run's status.

Ranks send what a terminal would show of their output (``executor/termline.py``): finished lines,
and the line being drawn (a progress bar) as live lines. :class:`Display` renders them for where
they go, chosen once from the ``stdout`` stream:

- **a Jupyter cell** (the stream is ipykernel's): finished lines print as they come; the bar of a
  shown rank is one output updated in place (IPython's ``display(..., display_id=True)``), emptied
  when its line is finished, so the cell keeps one line per epoch; the run's status is a small
  table updated in place, which ends as the run's summary;
- **a terminal** (a tty): finished lines print as they come; the bottom line is redrawn in place
  with ``\\r``: the shown rank's bar, else the run's status; the summary ends the run;
- **anything else** (a file, a job's log, a pipe): finished lines only; a bar reaches it once, in
  its last state, when its line is finished. The summary goes to the ``sparktrain`` logger (INFO).

Live lines are shown from ``live_ranks`` only (rank 0 unless ``output_ranks`` names others); the
other ranks' bars are not shown, their finished lines are: in a cell or on a terminal within a rate,
with a note of what was held back (``outputlimit``). ``verbose=0`` shows no status or summary.
It reads events, never rank code.
"""
from __future__ import annotations

import datetime
import html
import logging
import shutil
import sys
import time
from typing import IO, Iterable

from .outputlimit import ALL_LINES_UP_TO, OutputLimit

log = logging.getLogger(__name__)

#: Seconds between two redraws of the status's elapsed time.
STATUS_SECONDS = 1.0


def sink_kind(stream) -> str:
    """``"jupyter"``, ``"terminal"`` or ``"plain"``: what ``stream`` can draw."""
    module = type(stream).__module__ or ""
    if module.startswith("ipykernel"):
        return "jupyter"
    try:
        return "terminal" if stream.isatty() else "plain"
    except (AttributeError, ValueError, OSError):
        return "plain"


class Display:
    """One run's output and status, rendered for its ``stdout``'s kind (see the module's docstring)."""

    def __init__(self, stdout: IO[str] | None, stderr: IO[str] | None, timestamps: bool, verbose: int,
                 size: int = 0, live_ranks: Iterable[int] | None = None, title: str = "run"):
        self.out = stdout or sys.stdout
        self.err = stderr or sys.stderr
        self.timestamps = timestamps
        self.verbose = verbose
        self.size = size
        self.live_ranks = frozenset({0} if live_ranks is None else live_ranks)
        self.title = title
        self.kind = sink_kind(self.out)
        self.started = time.monotonic()
        self.hosts: dict[int, str] = {}
        self._live: dict[tuple[int, str], object] = {}   # (rank, stream) -> its text, or a Jupyter handle
        self._bottom = ""                                   # what the terminal's last line shows now
        self._status_handle = None
        self._status_at = 0.0
        #: How the run ended, as the summary says (the attempt that succeeded sets it).
        self.outcome = "finished"
        #: The run keeps every line in its log_url (said in the note of what was held back).
        self.logged = False
        self._limit = OutputLimit(self.live_ranks)
        self._log_filter = self._before_log  # a callable is a logging filter
        self._filtered: list[logging.Handler] = []

    # -- the ranks' output ---------------------------------------------------------------------------
    def write(self, rank: int, stream: str, line: str, at: float, live: bool = False, drawn: bool = False) -> None:
        """One rank's line: finished, or ``live`` (being drawn); ``drawn``: a finished progress bar,
        shown from the live ranks only."""
        if live:
            if line:
                self._show_live(rank, stream, self._prefix(rank, stream, at) + line)
            return
        self._end_live(rank, stream)
        if drawn and rank not in self.live_ranks:
            return
        if self.kind != "plain" and self.size > ALL_LINES_UP_TO:
            # A cell or a terminal, many ranks: the other ranks' lines within a rate (outputlimit).
            now = time.monotonic()
            self._limit.shown = self.live_ranks
            if not self._limit.admit(rank, now):
                self._note(now)
                return
        out = self.err if stream == "stderr" else self.out
        self._clear_bottom()
        self._emit(out, self._prefix(rank, stream, at) + line + "\n")
        self._draw_bottom()

    def _prefix(self, rank: int, stream: str, at: float) -> str:
        prefix = f"[{rank}]<{stream}>:"
        if self.timestamps:
            prefix = datetime.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " " + prefix
        return prefix

    def _show_live(self, rank: int, stream: str, text: str) -> None:
        if rank not in self.live_ranks or self.kind == "plain":
            return
        key = (rank, stream)
        if self.kind == "jupyter":
            handle = self._live.get(key)
            if handle is None:
                self._live[key] = _jupyter_display(text)
            else:
                handle.update({"text/plain": text}, raw=True)
            return
        self._live[key] = text
        self._bottom_text(text)

    def _end_live(self, rank: int, stream: str) -> None:
        """The line being drawn was finished: its finished state prints as a line; the live one goes."""
        handle = self._live.pop((rank, stream), None)
        if handle is None:
            return
        if self.kind == "jupyter":
            handle.update({"text/plain": ""}, raw=True)
        else:
            self._bottom_text(next(iter(self._live.values()), self._status_text() if self.verbose >= 1 else ""))

    # -- the run's status ----------------------------------------------------------------------------
    def rank_up(self, rank: int, host: str) -> None:
        self.hosts[rank] = host
        # Redrawn at once for the first and the last rank; in between at the status's pace, so that
        # a thousand ranks checking in are not a thousand redraws.
        self.tick(force=len(self.hosts) in (1, self.size))

    def _note(self, now: float, force: bool = False) -> None:
        """Say what the output limit held back (see outputlimit), as a line of its own."""
        text = self._limit.note(now, self.logged, force)
        if text:
            self._clear_bottom()
            self._emit(self.out, text + "\n")
            self._draw_bottom()

    def tick(self, force: bool = False) -> None:
        """Redraw the status (its elapsed time) at most every STATUS_SECONDS, unless ``force``."""
        now = time.monotonic()
        if self.kind != "plain":
            self._note(now)
        if self.verbose < 1 or self.kind == "plain" or (not force and now - self._status_at < STATUS_SECONDS):
            return
        self._status_at = now
        if self.kind == "jupyter":
            self._status_handle = _jupyter_status(self._status_handle, self._status_html(), self._status_text())
        elif not self._live:
            self._bottom_text(self._status_text())

    def attach(self, logger: logging.Logger) -> None:
        """On a terminal, clear the bottom line before ``logger``'s handlers (or the root's) write a
        record, so that the driver's own messages do not run into it; :meth:`finish` detaches."""
        if self.kind != "terminal":
            return
        handlers = logger.handlers if logger.handlers or not logger.propagate else logging.getLogger().handlers
        for handler in handlers:
            handler.addFilter(self._log_filter)
            self._filtered.append(handler)

    def _before_log(self, record) -> bool:
        self._clear_bottom()
        return True

    def finish(self, outcome: str | None = None) -> None:
        """The run ended with ``outcome`` (default :attr:`outcome`: what rank 0 returned; or which ranks
        failed): the summary."""
        outcome = outcome or self.outcome
        for handler in self._filtered:
            handler.removeFilter(self._log_filter)
        self._filtered.clear()
        for rank, stream in list(self._live):
            self._end_live(rank, stream)
        if self.kind != "plain":
            self._note(time.monotonic(), force=True)
        if self.verbose < 1:
            return
        text = self._status_text(outcome)
        if self.kind == "jupyter":
            self._status_handle = _jupyter_status(self._status_handle, self._status_html(outcome), text)
        elif self.kind == "terminal":
            self._bottom_text("")
            self._emit(self.out, text + "\n")
        else:  # a file or a job's log holds the ranks' lines alone; the driver's own words go to its log
            log.info("%s", text)

    def _status_text(self, outcome: str | None = None) -> str:
        elapsed = time.monotonic() - self.started
        where = _placement(self.hosts)
        if outcome is None:
            return f"sparktrain {self.title}: {len(self.hosts)}/{self.size} ranks up{where} · {elapsed:.0f} s"
        return f"sparktrain {self.title}: {outcome} · {self.size} ranks{where} · {elapsed:.1f} s"

    def _status_html(self, outcome: str | None = None) -> str:
        cells = [("run", self.title), ("ranks up", f"{len(self.hosts)}/{self.size}"),
                 ("hosts", _placement(self.hosts).removeprefix(" on ") or "-"),
                 ("elapsed", f"{time.monotonic() - self.started:.0f} s")]
        if outcome is not None:
            cells.append(("outcome", outcome))
        head = "".join(f"<th>{html.escape(k)}</th>" for k, _ in cells)
        body = "".join(f"<td>{html.escape(v)}</td>" for _, v in cells)
        return f"<table class='sparktrain-status'><tr>{head}</tr><tr>{body}</tr></table>"

    # -- the terminal's bottom line --------------------------------------------------------------------
    def _bottom_text(self, text: str) -> None:
        if self.kind != "terminal":
            return
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        self._bottom = text[:width]
        self._emit(self.out, "\r" + self._bottom + "\x1b[K")

    def _clear_bottom(self) -> None:
        if self.kind == "terminal" and self._bottom:
            self._emit(self.out, "\r\x1b[K")

    def _draw_bottom(self) -> None:
        if self.kind == "terminal" and self._bottom:
            self._emit(self.out, self._bottom)

    @staticmethod
    def _emit(out: IO[str], text: str) -> None:
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass  # a closed stream must not stop training


def _placement(hosts: dict[int, str]) -> str:
    if not hosts:
        return ""
    counts: dict[str, int] = {}
    for host in hosts.values():
        counts[host] = counts.get(host, 0) + 1
    return " on " + ", ".join(f"{h} ({n})" if n > 1 else h for h, n in counts.items())


def _jupyter_display(text: str):
    from IPython.display import display

    return display({"text/plain": text}, raw=True, display_id=True)


def _jupyter_status(handle, html_text: str, text: str):
    bundle = {"text/html": html_text, "text/plain": text}
    if handle is None:
        from IPython.display import display

        return display(bundle, raw=True, display_id=True)
    handle.update(bundle, raw=True)
    return handle
