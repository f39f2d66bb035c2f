"""Entry point of one rank's process: ``python -m sparktrain.child WORKDIR PARENT_PID``.

It loads ``WORKDIR/payload.pkl`` (cloudpickled ``(train_fn, args, kwargs)``), calls the
function, and leaves behind either ``result.pkl`` (rank 0 only) or ``error.json``. Both are
written under a temporary name and renamed, so the parent never reads half a file.

It must die with its parent, even while the user's code is stuck in C:
- a parent-death signal (SIGTERM) is set first thing, then the parent pid is re-checked to
  close the race with a parent that died before that;
- a lifeline thread waits for EOF on stdin (the parent holds the other end) and polls the
  parent pid; when the parent is gone it SIGKILLs the whole process group.
A SIGTERM while the parent lives is a polite stop: it raises SystemExit so ``finally``
blocks run, and the parent follows up with SIGKILL after its grace period.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import threading
import traceback

from . import worker_env

_PR_SET_PDEATHSIG = 1
EXIT_TERMINATED = 128 + signal.SIGTERM


def _parent_gone(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


def _kill_group() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _install_lifeline(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if _parent_gone(parent_pid):
        _kill_group()

    def on_sigterm(signum, frame):
        if _parent_gone(parent_pid):
            _kill_group()
        raise SystemExit(EXIT_TERMINATED)

    signal.signal(signal.SIGTERM, on_sigterm)

    # Keep the lifeline pipe on a private fd; user code gets /dev/null as stdin.
    lifeline = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def watch():
        while True:
            ready, _, _ = select.select([lifeline], [], [], 1.0)
            if ready and not os.read(lifeline, 4096):
                break  # EOF: the parent closed its end or died
            if _parent_gone(parent_pid):
                break
        if _parent_gone(parent_pid):
            _kill_group()
        # EOF with the parent alive means the parent is stopping us; it sends the signals.

    threading.Thread(target=watch, name="sparktrain-lifeline", daemon=True).start()


def _type_name(exc: BaseException) -> str:
    t = type(exc)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _report_error(workdir: str, exc: BaseException, message: str | None = None) -> None:
    info = {
        "exc_type": _type_name(exc),
        "message": message if message is not None else str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    _write_atomic(os.path.join(workdir, "error.json"), json.dumps(info).encode())


def _upload(result, url: str, storage_options) -> str:
    """Send rank 0's value straight to ``url``: bytes as they are, a local file or directory by path."""
    from . import storage

    if isinstance(result, (bytes, bytearray, memoryview)):
        return storage.put_bytes(url, bytes(result), storage_options)
    if isinstance(result, (str, os.PathLike)) and os.path.isfile(result):
        return storage.put_file(os.fspath(result), url, storage_options)
    if isinstance(result, (str, os.PathLike)) and os.path.isdir(result):
        return storage.put_dir(os.fspath(result), url, storage_options)
    raise TypeError(
        f"with checkpoint_url, rank 0's train_fn must return bytes or the path of a local file or directory; "
        f"it returned {type(result).__name__}: {str(result)[:100]!r}")


def main(argv: list[str]) -> int:
    workdir, parent_pid = argv[0], int(argv[1])
    _install_lifeline(parent_pid)
    import cloudpickle

    try:
        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
    except BaseException as e:  # noqa: BLE001 - report whatever stopped the unpickling
        _report_error(workdir, e, f"could not unpickle train_fn on this executor: {e}. "
                                  "Install the same packages on the executors as on the driver")
        return 1

    try:
        result = fn(*args, **kwargs)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            _report_error(workdir, e, f"train_fn called sys.exit({e.code!r})")
        return code
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the driver
        _report_error(workdir, e)
        return 1

    if os.environ.get(worker_env.RANK) == "0":
        target = os.path.join(workdir, "checkpoint.pkl")
        if os.path.exists(target):
            try:
                with open(target, "rb") as f:
                    url, storage_options = cloudpickle.load(f)
                result = _upload(result, url, storage_options)
            except BaseException as e:  # noqa: BLE001
                _report_error(workdir, e)
                return 1
        path = os.path.join(workdir, "result.pkl")
        try:
            # Straight to disk: a large result is not held twice in memory.
            with open(path + ".partial", "wb") as f:
                cloudpickle.dump(result, f)
        except BaseException as e:  # noqa: BLE001
            _report_error(
                workdir, e,
                f"rank 0's return value ({type(result).__name__}) cannot be pickled: {e}. "
                "Return bytes, a path or URL, or plain Python/numpy data instead",
            )
            return 1
        os.replace(path + ".partial", path)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
