"""How many ranks' lines a notebook cell or a terminal shows: all of the shown ranks', a few of the others'.

With hundreds of ranks printing, a cell that printed every line would be unusable (and the browser
slow). So in a cell or on a terminal, for a run of more than :data:`ALL_LINES_UP_TO` ranks, the finished lines of the shown ranks (rank 0, or the ranks
``output_ranks`` names) always print, and the other ranks' lines print up to :data:`RATE` a
second (bursts of :data:`BURST`); what is held back is counted, and a note says so at most every
:data:`NOTE_SECONDS` and when the run ends. A file, a job's log or a pipe (``stdout=`` anything
else) gets every line; so does ``log_url``, and a failed rank's last lines come with its error.
"""
from __future__ import annotations

#: Runs of up to this many ranks show every line of every rank, wherever they print.
ALL_LINES_UP_TO = 16
#: Lines per second printed, in all, from the ranks that are not shown ranks.
RATE = 10.0
#: How many of those may print at once, after a quiet while.
BURST = 50
#: Seconds between two notes of what was held back.
NOTE_SECONDS = 10.0


class OutputLimit:
    """A token bucket for the lines of ranks other than ``shown``, and the count of what it held back."""

    def __init__(self, shown: frozenset[int], rate: float = RATE, burst: int = BURST):
        self.shown = shown
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at: float | None = None
        self._held = 0
        self._held_ranks: set[int] = set()
        self._since: float | None = None

    def admit(self, rank: int, now: float) -> bool:
        """Whether ``rank``'s line prints now; one that does not is counted as held back."""
        if rank in self.shown:
            return True
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        if not self._held:
            self._since = now
        self._held += 1
        self._held_ranks.add(rank)
        return False

    def note(self, now: float, kept: bool, force: bool = False) -> str | None:
        """What was held back since the last note, once NOTE_SECONDS passed (or ``force``); None
        when nothing was. ``kept``: the run writes every line to its ``log_url``."""
        if not self._held or (not force and now - self._since < NOTE_SECONDS):
            return None
        where = ("every line is in log_url" if kept else
                 "pass log_url= to keep every line, or stdout= a file; a failed rank's last lines come with its error")
        shown = ", ".join(map(str, sorted(self.shown))) or "none"
        text = (f"sparktrain: held back {self._held:,} line(s) of {len(self._held_ranks):,} rank(s) in "
                f"{max(1.0, now - self._since):.0f} s (shown: every line of rank(s) {shown}, and up to "
                f"{self.rate:g} lines/s of the others; {where})")
        self._held, self._held_ranks, self._since = 0, set(), None
        return text
