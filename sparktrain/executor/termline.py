"""What a terminal would show of a rank's output stream: lines redrawn in place, without codes.

Progress bars (Keras' ``Progbar``, which draws for a terminal wherever ``"posix" in sys.modules``,
and ``tqdm``) redraw their line with ``\\r`` and runs of ``\\b`` and colour it with ANSI escape codes.
:class:`TermLine` plays a stream's text onto one line as a terminal would, so that a rank sends the
driver what a person would have seen: finished lines (each once, at its ``\\n``, in its last state)
and, meanwhile, the line being drawn (:attr:`TermLine.current`), which the driver may show as one
live line; a finished line that was redrawn first is marked ``drawn``. No ``\\b``, ``\\r`` or
escape code leaves it.

>>> t = TermLine()
>>> t.feed("\\x1b[1m 1/3\\x1b[0m [=..]\\b\\b\\b\\b\\b\\b\\b\\b\\b\\b\\r 2/3 [==.]"), t.current
([], ' 2/3 [==.]')
>>> t.feed("\\r 3/3 [===] loss: 0.1\\nnext"), t.current
([' 3/3 [===] loss: 0.1'], 'next')
"""
from __future__ import annotations

import codecs
import re

#: CSI sequences (colours, cursor moves, erasing) and the two-byte escapes; all are dropped.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
#: An escape sequence cut off at the end of a read; kept until its end arrives.
_PARTIAL_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*)?$")
_CONTROL = re.compile(r"([\r\n\b])")


class Line(str):
    """A finished line; ``drawn`` when it was redrawn in place before it was finished (a progress
    bar's last state)."""

    drawn: bool = False


class TermLine:
    """One output stream played onto a terminal line; see the module's docstring.

    ``max_line``: a line that grows past it is finished there (and the rest starts a new line).
    """

    def __init__(self, max_line: int = 16 * 1024):
        self.max_line = max_line
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._cells: list[str] = []
        self._col = 0
        self._drawn = False
        #: Whether :attr:`current` changed since :meth:`seen` was last called.
        self.changed = False

    @property
    def current(self) -> str:
        """The unfinished line as a terminal shows it now (trailing blanks dropped)."""
        return "".join(self._cells).rstrip()

    def seen(self) -> str:
        """:attr:`current`, marked as passed on."""
        self.changed = False
        return self.current

    def feed_bytes(self, data: bytes) -> list[str]:
        """:meth:`feed` for raw bytes of UTF-8 (a character split between reads waits for its end)."""
        return self.feed(self._decoder.decode(data))

    def feed(self, text: str) -> list[Line]:
        """Play ``text`` onto the line; returns the lines it finished, in order."""
        text = self._pending + text
        cut = _PARTIAL_ESCAPE.search(text)
        self._pending, text = (text[cut.start():], text[:cut.start()]) if cut else ("", text)
        done: list[str] = []
        for piece in _CONTROL.split(_ESCAPE.sub("", text)):
            if not piece:
                continue
            if piece == "\n":
                done.append(self._finish())
            elif piece == "\r":
                self._col = 0
                self._drawn = self._drawn or bool(self._cells)
            elif piece == "\b":
                self._col = max(0, self._col - 1)
                self._drawn = self._drawn or bool(self._cells)
            else:
                self._write(piece, done)
            self.changed = True
        return done

    def close(self) -> list[str]:
        """The stream ended: what was left unfinished, as a last line (none if blank)."""
        rest = self.feed(self._decoder.decode(b"", final=True) + self._pending)
        self._pending = ""
        if self.current:
            rest.append(self._finish())
        return rest

    def _write(self, piece: str, done: list[str]) -> None:
        while piece:
            room = self.max_line - self._col
            part, piece = piece[:room], piece[room:]
            end = self._col + len(part)
            if self._col > len(self._cells):
                self._cells.extend(" " * (self._col - len(self._cells)))
            self._cells[self._col:end] = part
            self._col = end
            if self._col >= self.max_line:
                done.append(self._finish())

    def _finish(self) -> Line:
        line = Line(self.current)
        line.drawn = self._drawn
        self._cells, self._col, self._drawn = [], 0, False
        self.changed = True
        return line
