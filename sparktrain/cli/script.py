"""Training scripts as rank functions, for ``sparktrain run train.py``.

The driver reads the script and checks that it compiles (:func:`load`); every rank then runs
the shipped text as ``__main__`` (:func:`run_script`), so executors need not see the driver's
files. Only the standard library is used on the rank side.
"""
from __future__ import annotations

import os
import sys

from ..errors import InvalidArgumentError


def load(path: str) -> bytes:
    """Read the script at ``path`` on the driver and compile it once, so a typo fails here.

    >>> load("/no/such/train.py")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    InvalidArgumentError: script '/no/such/train.py' does not exist ...
    """
    if not os.path.exists(path):
        raise InvalidArgumentError(f"script {path!r} does not exist (looked in {os.getcwd()}); "
                                   "pass the path of a Python file such as train.py")
    if not os.path.isfile(path):
        raise InvalidArgumentError(f"script {path!r} is not a file; pass the path of a Python file such as train.py")
    with open(path, "rb") as f:
        source = f.read()
    try:
        compile(source, path, "exec")
    except SyntaxError as e:
        raise InvalidArgumentError(f"script {path!r} does not compile: {e.msg} (line {e.lineno}); "
                                   "fix it before launching") from None
    return source


def run_script(path: str, source: bytes, argv: list[str]) -> None:
    """Run ``source`` as ``__main__`` on this rank, as ``python path ARGV...`` would.

    Where ``path`` holds the same text here (one machine, or a shared filesystem), the file
    itself runs, so ``__file__`` and imports of modules beside it work as with ``python path``.
    Elsewhere the shipped text is written to a temporary directory and runs from there; then
    ``__file__`` and ``sys.argv[0]`` name that copy.
    """
    import runpy
    import tempfile

    target = path
    try:
        with open(path, "rb") as f:
            same = f.read() == source
    except OSError:
        same = False
    scratch = None
    if not same:
        scratch = tempfile.TemporaryDirectory(prefix="sparktrain-script-")
        target = os.path.join(scratch.name, os.path.basename(path))
        with open(target, "wb") as f:
            f.write(source)
    # As `python path` does: the script's directory first on sys.path, its arguments in sys.argv
    # (run_path puts the file that runs in sys.argv[0]).
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    sys.argv = [target, *argv]
    try:
        runpy.run_path(target, run_name="__main__")
    finally:
        if scratch is not None:
            scratch.cleanup()
