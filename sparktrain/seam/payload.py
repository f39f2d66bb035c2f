"""Pickling ``train_fn`` so that a rank's traceback shows the user's source lines.

cloudpickle pickles a notebook's or script's functions by value, and since 3.1.3 it names their
code ``<dynamic-code>``. A rank's traceback then shows neither the file nor the line that failed,
on any host. :func:`dumps` keeps each function's file name and ships the lines of that file with
it (once per file, for files up to :data:`MAX_SOURCE_BYTES`); unpickling puts them in the rank's
``linecache``, so the traceback reads as it would on the driver, even on an executor that has no
such file (a notebook cell's lives only on the driver).
"""
from __future__ import annotations

import io
import linecache
import types
from typing import Any, Callable

#: Source files larger than this travel without their lines.
MAX_SOURCE_BYTES = 1 << 20


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, with the file names and lines of code pickled by value.

    >>> import pickle
    >>> pickle.loads(dumps(len)) is len
    True
    """
    import cloudpickle

    buf = io.BytesIO()
    _SourcePickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def _lines(filename: str) -> list[str] | None:
    lines = linecache.getlines(filename)
    return lines if lines and sum(map(len, lines)) <= MAX_SOURCE_BYTES else None


def _code_with_source(rebuild: Callable[..., types.CodeType], args: tuple, filename: str,
                      lines: list[str] | None) -> types.CodeType:
    """Unpickle a code object, and give ``linecache`` its file's lines (see the module's doc)."""
    if lines:
        # An mtime of None: linecache.checkcache keeps the entry whether or not the file exists here.
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return rebuild(*args)


def _make_pickler():
    import cloudpickle
    from cloudpickle import cloudpickle as implementation

    code_reduce = implementation.Pickler._dispatch_table.get(types.CodeType)

    class SourcePickler(cloudpickle.Pickler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._sources: dict[str, list[str] | None] = {}  # one list per file: pickle stores it once

        def reduce_code(self, code: types.CodeType):
            rebuild, args = code_reduce(code)
            filename = code.co_filename
            if filename.startswith("<") or filename in args:
                return rebuild, args  # nothing to restore, or cloudpickle kept the name itself
            if filename not in self._sources:
                self._sources[filename] = _lines(filename)
            named = tuple(filename if a == "<dynamic-code>" else a for a in args)
            return _code_with_source, (rebuild, named, filename, self._sources[filename])

        def reducer_override(self, obj):
            if type(obj) is types.CodeType and code_reduce is not None:
                return self.reduce_code(obj)
            return super().reducer_override(obj)

    return SourcePickler


class _LazyPickler:
    """Builds the pickler class at first use: cloudpickle is imported only when a run pickles."""

    cls = None

    def __call__(self, *args, **kwargs):
        if _LazyPickler.cls is None:
            _LazyPickler.cls = _make_pickler()
        return _LazyPickler.cls(*args, **kwargs)


_SourcePickler = _LazyPickler()
