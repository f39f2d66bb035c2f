"""The settings a rank reads, parsed once, at the rank's start, into one frozen value.

The driver resolved every setting before launch (``driver.launch.config``), refusing bad values there,
and handed each rank those it reads in its environment (``settings.READ_IN_RANK``). The rank's
process parses them once, as it starts (``executor.child``), and its modules (the engine, the
TensorFlow layer, elastic state) read :func:`current`. Outside a rank (a test, a plain process)
:func:`current` parses the process's environment each time it is asked.
"""
from __future__ import annotations

import os
from typing import Mapping

from .. import settings

_loaded: settings.RankSettings | None = None


def parse(environ: Mapping[str, str] | None = None) -> settings.RankSettings:
    """The rank-read settings from ``environ`` (default: this process's environment)."""
    return settings.resolve_all(conf=None, environ=os.environ if environ is None else environ,
                                record=settings.RankSettings)


def load(environ: Mapping[str, str] | None = None) -> settings.RankSettings:
    """Parse this rank's settings once, for :func:`current` to return from now on."""
    global _loaded
    _loaded = parse(environ)
    return _loaded


def current() -> settings.RankSettings:
    """This rank's settings: those :func:`load` parsed, else the environment's now."""
    return _loaded if _loaded is not None else parse()
