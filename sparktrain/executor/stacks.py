"""What the task tells the driver about a rank that may be stalled: the rank's progress with
every beat, and its threads' stacks when the driver asks.

The driver (``sparktrain.driver.supervise.stalls``) compares the ranks' progress; when some have waited in a
collective for ``stall_warning`` seconds, it asks the ranks that have not arrived for their stacks.
The task then signals its rank (``ChildProcess.request_stacks``) and collects what the rank's
``faulthandler`` writes to the stacks pipe until the pipe has been quiet for a moment.
"""
from __future__ import annotations

import os

from ..seam import protocol
from ..engine import progress

#: Once the dump began, this much quiet on the pipe means it is complete.
QUIET_SECONDS = 0.3
#: A rank that has not answered within this long is reported without its stack.
ANSWER_SECONDS = 3.0
#: Longest stack text sent (the channel's frames are at most 1 MiB).
MAX_BYTES = 256 * 1024


def beat(progress_path: str | None) -> protocol.Beat:
    """The beat message: with the rank's progress when there is one to read."""
    return protocol.Beat(progress.read(progress_path) if progress_path else None)


class StackDump:
    """One request for the rank's stacks at a time, collected from its pipe."""

    def __init__(self):
        self.asked: float | None = None
        self._data = bytearray()
        self._last = 0.0

    def ask(self, child, now: float) -> bool:
        """Signal the rank; False (nothing to wait for) when it has exited."""
        if self.asked is not None:
            return True  # one dump answers every request made while it is collected
        if not child.request_stacks():
            return False
        self.asked, self._data = now, bytearray()
        return True

    def read(self, fd: int, now: float) -> bool:
        """Take what the rank wrote (read whenever the pipe is readable, asked or not); False once
        the pipe is closed (the rank and all it started have exited)."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            if self.asked is not None and len(self._data) < MAX_BYTES:
                self._data += chunk[:MAX_BYTES - len(self._data)]
                self._last = now

    def done(self, now: float) -> str | None:
        """The stacks, once complete (or "" when the rank did not answer in time); else None."""
        if self.asked is None:
            return None
        if (self._data and now - self._last >= QUIET_SECONDS) or now - self.asked >= ANSWER_SECONDS:
            text, self.asked = self._data.decode(errors="replace"), None
            return text
        return None
