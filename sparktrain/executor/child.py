"""Entry point of one rank's process: ``python -m sparktrain.executor.child WORKDIR PARENT_PID [--go FD] [--stacks FD]``.

It loads the run's storage options (``sparktrain.storage.rank``) and ``WORKDIR/payload.pkl``
(cloudpickled ``(train_fn, args, kwargs)``), calls the function, and leaves behind either rank 0's
value (``value.pkl``) or ``error.json`` (``workdirs`` names them). Both are written under a temporary
name and renamed, so the parent never reads half a file.

Held (``--go FD``), it waits before it reads anything of the user's until the task writes the
rank's whole environment down that pipe (see ``ChildProcess.go``), and takes it as its own.

With ``--stacks FD``, SIGUSR1 makes it write every thread's Python stack (``faulthandler``) to that
pipe, from the signal handler itself, so a rank busy in C code or in a sleep still answers: the
task asks for it when the driver reports a stall or the user interrupts the run.

It dies with its parent (the barrier task): a parent-death signal (SIGTERM) is set first
thing, then the parent pid is re-checked to close the race with a parent that died before that;
if the parent is gone, the rank ends its own process group. The rank's watcher (watcher.py)
covers the rank stuck in C code, which a signal handler cannot interrupt. A SIGTERM while the
parent lives is a polite stop: it raises SystemExit so ``finally`` blocks run, and the parent
follows up with SIGKILL after its grace period.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Mapping

from ..settings import rank as rank_settings
from ..seam import tracking, worker_env
from ..errors import InvalidArgumentError, type_name
from ..host.localfiles import replaced_atomically, write_atomically
from ..storage import rank as rank_storage
from . import workdirs

_PR_SET_PDEATHSIG = 1
EXIT_TERMINATED = 128 + signal.SIGTERM
#: A held child whose go pipe closed without a go: it ran nothing. Not 0, so that a rank whose
#: process was never let go can never pass for one that ran and succeeded.
EXIT_NOT_LET_GO = 120


def _set_parent_death_signal(sig: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _end_group() -> None:
    """The task is gone: end this rank's whole group, this process included (it is a member, so
    the group is its own)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _die_with_parent(parent_pid: int) -> None:
    _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        _end_group()

    def on_sigterm(signum, frame):
        if os.getppid() != parent_pid:
            _end_group()
        raise SystemExit(EXIT_TERMINATED)

    signal.signal(signal.SIGTERM, on_sigterm)


def _report_error(workdir: str, exc: BaseException, message: str | None = None) -> None:
    info = {
        "exc_type": type_name(exc),
        "message": message if message is not None else str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        # When it happened: the root cause is the first failure in time, and a peer that fails
        # because of it may report sooner than this rank's exit is noticed.
        "time": time.time(),
    }
    write_atomically(os.path.join(workdir, workdirs.ERROR), json.dumps(info).encode(), durable=True)


def _upload(result: Any, url: str, storage_options: Mapping[str, Any] | None) -> str:
    """Send rank 0's value straight to ``url``: bytes as they are, a local file or directory by path."""
    from .. import storage

    if isinstance(result, (bytes, bytearray, memoryview)):
        return storage.put_bytes(url, bytes(result), storage_options)
    if isinstance(result, (str, os.PathLike)) and os.path.isfile(result):
        return storage.put_file(os.fspath(result), url, storage_options)
    if isinstance(result, (str, os.PathLike)) and os.path.isdir(result):
        return storage.put_dir(os.fspath(result), url, storage_options)
    raise TypeError(
        f"with checkpoint_url, rank 0's train_fn must return bytes or the path of a local file or directory; "
        f"it returned {type(result).__name__}: {str(result)[:100]!r}")


def _await_go(fd: int) -> dict | None:
    """A held child's go (see ``ChildProcess.go``): ``{"env": the rank's whole environment}``, or
    None when the task closed the pipe without one (it does not need this process)."""
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks)) if chunks else None


def _pin_cores() -> None:
    cores = os.environ.get(worker_env.CORES)
    if cores:  # before any thread starts: every thread the rank starts later keeps to them too
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})


def _set_gc_threshold(value: str) -> None:
    """The ``gc_threshold`` setting, before anything of the user's loads: with Python's own, the
    oldest generation is traversed again each time the heap grows by a quarter, several times over
    while TensorFlow and Keras import."""
    if value != "python":
        gc.set_threshold(*(int(n) for n in value.split(",")))


def main(argv: list[str]) -> int:
    workdir, parent_pid = argv[0], int(argv[1])
    go = int(argv[argv.index("--go") + 1]) if "--go" in argv[2:] else None
    if go is None:
        _pin_cores()
    _die_with_parent(parent_pid)
    if "--stacks" in argv[2:]:
        import faulthandler

        # Ignored first: faulthandler restores the handler it found when the interpreter shuts
        # down, and a request that arrives then (a stall seen just as the rank finished) must not
        # kill a rank that succeeded.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        faulthandler.register(signal.SIGUSR1, file=int(argv[argv.index("--stacks") + 1]), all_threads=True)
    import cloudpickle

    if go is not None:
        # Held: started while the ranks meet; nothing of the user's has run or been read yet.
        message = _await_go(go)
        if message is None:
            return EXIT_NOT_LET_GO
        os.environ.clear()
        os.environ.update(message["env"])
        _pin_cores()
    try:
        # The rank's settings, parsed once (the driver refused bad values before launch).
        _set_gc_threshold(rank_settings.load().gc_threshold)
    except InvalidArgumentError as e:
        _report_error(workdir, e)
        return 1

    what = "the run's storage_options"
    try:
        rank_storage.load(workdir)  # run(storage_options=), once, for everything of the run's on storage
        what = "train_fn"
        with open(os.path.join(workdir, workdirs.PAYLOAD), "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
    except BaseException as e:  # noqa: BLE001 - report whatever stopped the unpickling
        _report_error(workdir, e, f"could not unpickle {what} on this executor: {e}. "
                                  "Install the same packages on the executors as on the driver")
        return 1

    try:
        try:
            result = fn(*args, **kwargs)
        finally:
            tracking.release_run()  # the driver's MLflow run ends when the driver says so
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            _report_error(workdir, e, f"train_fn called sys.exit({e.code!r})")
            return code
        result = None  # sys.exit(0) is a success that returns nothing
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the driver
        _report_error(workdir, e)
        return 1

    if os.environ.get(worker_env.RANK) == "0":
        target = os.path.join(workdir, workdirs.CHECKPOINT_URL)
        if os.path.exists(target):
            try:
                with open(target) as f:
                    url = f.read()
                result = _upload(result, url, rank_storage.options())
            except BaseException as e:  # noqa: BLE001
                _report_error(workdir, e)
                return 1
        try:
            # Straight to disk: a large result is not held twice in memory.
            with replaced_atomically(os.path.join(workdir, workdirs.VALUE)) as tmp, open(tmp, "wb") as f:
                cloudpickle.dump(result, f)
        except BaseException as e:  # noqa: BLE001
            _report_error(
                workdir, e,
                f"rank 0's return value ({type(result).__name__}) cannot be pickled: {e}. "
                "Return bytes, a path or URL, or plain Python/numpy data instead",
            )
            return 1
    return 0


def leave(code: int) -> None:
    """Exit with ``code``. A rank that failed while JAX is loaded leaves at once, without Python's
    exit hooks: JAX's own waits at a shutdown barrier for every process of the run (for minutes
    when one is gone), and the others are being stopped because of this one anyway."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0 and "jax" in sys.modules:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
