"""Entry point of one rank's process: ``python -m sparktrain.executor.child WORKDIR PARENT_PID``.

It loads ``WORKDIR/payload.pkl`` (cloudpickled ``(train_fn, args, kwargs)``), calls the
function, and leaves behind either ``result.pkl`` (rank 0 only) or ``error.json``. Both are
written under a temporary name and renamed, so the parent never reads half a file.

It must die with its parent, even while the user's code is stuck in C:
- a parent-death signal (SIGTERM) is set first thing, then the parent pid is re-checked to
  close the race with a parent that died before that;
- a watcher process, forked before any user code runs, waits for EOF on the lifeline pipe
  (stdin; the parent holds the other end) and polls the parent; when the parent is gone it
  SIGKILLs the whole process group and removes the work directory the parent can no longer
  remove. It is a process, not a thread, because C code that blocks while holding the GIL
  (an eager TensorFlow collective, say) would starve a thread for as long as it blocks. It
  ends when the parent has removed the work directory, or with the group.
A SIGTERM while the parent lives is a polite stop: it raises SystemExit so ``finally``
blocks run, and the parent follows up with SIGKILL after its grace period.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import sys
import time
import traceback
from typing import Any, Mapping

from .. import tracking, worker_env
from ..errors import type_name
from ..localfiles import replaced_atomically, write_atomically

_PR_SET_PDEATHSIG = 1
EXIT_TERMINATED = 128 + signal.SIGTERM
#: A held child whose go pipe closed without a go: it ran nothing. Not 0, so that a rank whose
#: process was never let go can never pass for one that ran and succeeded.
EXIT_NOT_LET_GO = 120


def _parent_gone(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


#: The work directories this rank was given, the current one last: a warm rank process (see
#: ``executor.warm``) starts in a directory of its own and is moved into its run's at its go.
_workdirs: list[str] = []


def _abandoned(workdirs: list[str], pgid: int) -> None:
    """The task process is gone, so nobody else will clean up: remove the work directories, then
    kill the rank's whole group (whoever calls this too, if it is in it)."""
    for workdir in workdirs:
        shutil.rmtree(workdir, ignore_errors=True)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _set_parent_death_signal(sig: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _task_alive(rank_pid: int, parent_pid: int) -> bool:
    """Whether the task process that started the rank still runs."""
    rank = _stat(rank_pid)
    if rank is not None:  # the rank (or its zombie) still names its parent
        return int(rank[1]) == parent_pid
    if not os.path.exists("/proc/self/stat"):  # no procfs: ask the kernel directly
        try:
            os.kill(parent_pid, 0)
            return True
        except OSError:
            return False
    task = _stat(parent_pid)
    return task is not None and task[0] != "Z"


def _watch(rank_pid: int, parent_pid: int, lifeline: int, rank_exit: int, workdirs: list[str]) -> None:
    """The watcher process: if the task process that started the rank dies before it has cleaned
    up, kill the rank's group and remove the rank's work directory, which the task no longer can.

    Once the rank has exited, the watcher leaves the rank's process group, so the task does not
    wait for it as for a leftover descendant; it ends when the task has removed the directory.
    ``rank_exit`` is the read end of a pipe only the rank holds open: its EOF says, the moment the
    kernel closes the exiting rank's files, that the rank is gone. The task writes a line down the
    lifeline when it moves the rank into another work directory: the watcher then watches that one,
    and removes both if it is abandoned.
    """
    # A polite stop (SIGTERM to the group) must not end the watcher: if the task dies during
    # the grace period, before its SIGKILL, the watcher is what still ends the rank.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # never hold the rank's output pipes open
        os.dup2(devnull, fd)
    low, high = sorted((lifeline, rank_exit))
    os.closerange(3, low)
    os.closerange(low + 1, high)
    os.closerange(high + 1, 1024)
    watching = [lifeline, rank_exit]
    rank_exited = False
    in_rank_group = True
    moved = b""
    while os.path.exists(workdirs[-1]):
        ready, _, _ = select.select(watching, [], [], 0.2)
        for fd in ready:
            data = os.read(fd, 4096)
            if not data:
                # EOF on the lifeline: the task died, or closed its end to stop the rank (then it
                # sends the signals itself; keep watching in case it dies before it is done).
                watching.remove(fd)
                rank_exited = rank_exited or fd == rank_exit
            elif fd == lifeline:
                moved += data
                while b"\n" in moved:
                    line, moved = moved.split(b"\n", 1)
                    workdirs.append(os.fsdecode(line))
        if in_rank_group and (rank_exited or os.getppid() != rank_pid):  # the rank exited
            os.setpgid(0, 0)
            in_rank_group = False
        if not _task_alive(rank_pid, parent_pid):
            try:
                os.kill(rank_pid, signal.SIGKILL)  # first, so it writes nothing into the directory
            except ProcessLookupError:
                pass
            _abandoned(workdirs, rank_pid)  # the rank leads its own session, so its group id is its pid
            return
        if not watching:
            time.sleep(0.2)  # nothing to select on any more; poll


def _install_lifeline(parent_pid: int, workdir: str) -> None:
    _workdirs.append(workdir)
    _set_parent_death_signal(signal.SIGTERM)
    if _parent_gone(parent_pid):
        _abandoned(_workdirs, os.getpgrp())

    def on_sigterm(signum, frame):
        if _parent_gone(parent_pid):
            _abandoned(_workdirs, os.getpgrp())
        raise SystemExit(EXIT_TERMINATED)

    signal.signal(signal.SIGTERM, on_sigterm)

    # Keep the lifeline pipe on a private fd; user code gets /dev/null as stdin.
    lifeline = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    rank_pid = os.getpid()
    # Only this process keeps the write end (it is not inherited across exec), so the watcher
    # sees EOF when the rank exits.
    exit_read, _exit_write = os.pipe()
    if os.fork() == 0:
        try:
            _watch(rank_pid, parent_pid, lifeline, exit_read, list(_workdirs))
        finally:
            os._exit(0)
    os.close(lifeline)
    os.close(exit_read)


def _report_error(workdir: str, exc: BaseException, message: str | None = None) -> None:
    info = {
        "exc_type": type_name(exc),
        "message": message if message is not None else str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        # When it happened: the root cause is the first failure in time, and a peer that fails
        # because of it may report sooner than this rank's exit is noticed.
        "time": time.time(),
    }
    write_atomically(os.path.join(workdir, "error.json"), json.dumps(info).encode(), durable=True)


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
    """A held child's go (see ``ChildProcess.go``): ``{"env": changes to its environment, "workdir":
    its run's work directory or None}``, or None when the task closed the pipe without one (it does
    not need this process)."""
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


def main(argv: list[str]) -> int:
    workdir, parent_pid = argv[0], int(argv[1])
    go = int(argv[argv.index("--go") + 1]) if "--go" in argv[2:] else None
    if go is None:
        _pin_cores()
    _install_lifeline(parent_pid, workdir)
    import cloudpickle

    if go is not None:
        # Held: started while the ranks meet; nothing of the user's has run or been read yet.
        message = _await_go(go)
        if message is None:
            return EXIT_NOT_LET_GO
        if message.get("workdir"):
            workdir = message["workdir"]
            _workdirs.append(workdir)
        for name, value in message["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _pin_cores()

    try:
        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
    except BaseException as e:  # noqa: BLE001 - report whatever stopped the unpickling
        _report_error(workdir, e, f"could not unpickle train_fn on this executor: {e}. "
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
        target = os.path.join(workdir, "checkpoint.pkl")
        if os.path.exists(target):
            try:
                with open(target, "rb") as f:
                    url, storage_options = cloudpickle.load(f)
                result = _upload(result, url, storage_options)
            except BaseException as e:  # noqa: BLE001
                _report_error(workdir, e)
                return 1
        try:
            # Straight to disk: a large result is not held twice in memory.
            with replaced_atomically(os.path.join(workdir, "result.pkl")) as tmp, open(tmp, "wb") as f:
                cloudpickle.dump(result, f)
        except BaseException as e:  # noqa: BLE001
            _report_error(
                workdir, e,
                f"rank 0's return value ({type(result).__name__}) cannot be pickled: {e}. "
                "Return bytes, a path or URL, or plain Python/numpy data instead",
            )
            return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
