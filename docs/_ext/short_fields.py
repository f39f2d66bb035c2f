"""Reads sparktrain's docstring sections, which write ``name : what it is`` on one line, as NumPy's
``name`` line with the description indented below it, before napoleon renders them.

In a Parameters, Returns, Yields, Raises or Attributes section, a paragraph at the section's own
indentation that is not a ``name : ...`` line ends the section; it is rendered under "Notes".
"""
from __future__ import annotations

import re

SECTIONS = ("Parameters", "Other Parameters", "Returns", "Yields", "Raises", "Attributes")
FIELD = re.compile(r"^(\s*)([\w*.\[\], ]+?) : (.*)$")


def rewrite(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_section = False
    after_blank = False
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() in SECTIONS and set(nxt.strip()) == {"-"}:
            in_section = True
            out += [line, nxt]
            i += 2
            after_blank = False
            continue
        if set(line.strip()) == {"-"} and out and out[-1].strip():
            in_section = False  # another section's underline
        if in_section:
            m = FIELD.match(line)
            if m and not line.startswith(" "):
                out += [m.group(1) + m.group(2), m.group(1) + "    " + m.group(3)]
                after_blank = False
                i += 1
                continue
            if line.strip() and not line.startswith(" ") and after_blank:
                in_section = False
                out += ["Notes", "-----"]
        after_blank = not line.strip()
        out.append(line)
        i += 1
    return out


def process(app, what, name, obj, options, lines):
    lines[:] = rewrite(lines)


def setup(app):
    app.connect("autodoc-process-docstring", process, priority=400)  # before napoleon (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
