"""One watcher per rank: if the rank's task dies, it ends the rank and removes what the rank owns.

``python -I -S .../sparktrain/executor/watcher.py TASK_PID WORKDIR`` (standard library only)

The barrier task starts it first thing, before it makes anything the rank owns. It runs in its
own session, so signals to the rank's group never reach it, and it knows every process it acts
on through a pidfd, never through a pid number that may have been reused:

- **the task**: it opens a pidfd on ``TASK_PID`` and checks that the task is still its parent,
  so the pidfd names the task and not a process that took its pid after it died. The pidfd
  becomes readable when the task exits, whatever killed it (Spark kills a cancelled task's
  Python worker with SIGKILL).
- **the rank**: the task sends the rank process's pidfd over the socket that is the watcher's
  stdin (``SCM_RIGHTS``), opened while the rank was the task's unreaped child.
- **what the rank owns**: the task names each path (``own``): the work directory and the
  DataFrame spool.

When the task exits before it has said ``done`` (even before the watcher got as far as opening
its pidfd: on a loaded machine a task can live and die in less time than an interpreter takes to
start), the watcher reads what the task sent before it died, ends the rank's process group, and
then removes every path. It signals the group only while the rank is alive and stopped: a stopped
process cannot exit by itself, so its process group is still its own. Once the rank has exited,
the watcher never signals anything again: a rank's descendants that outlive both the rank and its
task are left alone, for their group may by then be a stranger's.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import sys

# The watcher's own start imports only the modules above, which its watch needs; shutil and
# subprocess are imported where they are used (by the task's side, which has them loaded
# already, and by the watcher only once its task is gone).

#: Seconds the task waits for its watcher to exit after ``done``.
FINISH_TIMEOUT = 10.0


def _command(task_pid: int, workdir: str) -> list[str]:
    """How the task starts its watcher: this file run as a script, isolated (``-I``: no PYTHON*
    variables, no user site, not the script's own directory on the path) and without ``site``
    (``-S``). It needs only the standard library, and every rank's launch waits for the CPU its
    start takes, on a host where each rank starts a watcher beside its rank process. Run as
    ``-m sparktrain.executor.watcher``, a watcher would also load site-packages and the sparktrain
    package, several times the CPU of the rest of its life. Where sparktrain is installed as a
    zip, the module is run by name instead."""
    if os.path.isfile(__file__):
        return [sys.executable, "-I", "-S", __file__, str(task_pid), workdir]
    return [sys.executable, "-m", __name__, str(task_pid), workdir]


class Watcher:
    """The task's handle on its rank's watcher (see the module's doc)."""

    def __init__(self, workdir: str):
        import subprocess

        self.paths = [workdir]
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(_command(os.getpid(), workdir),
                                         stdin=theirs.fileno(), stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        finally:
            theirs.close()
        self._sock = mine

    def own(self, path: str) -> None:
        """The rank owns ``path`` too: it goes if the task dies."""
        self.paths.append(path)
        self._send(f"own {path}\n".encode())

    def watch_rank(self, pidfd: int) -> None:
        """The rank's process, by a pidfd opened while it is this process's unreaped child."""
        self._send(b"rank\n", [pidfd])

    def _send(self, data: bytes, fds: list[int] | None = None) -> None:
        try:
            if fds:
                socket.send_fds(self._sock, [data], fds)
            else:
                self._sock.sendall(data)
        except OSError:
            pass  # the watcher is gone; finish() removes the paths itself

    def finish(self) -> None:
        """The task has ended the rank: the watcher exits without touching anything."""
        import shutil
        import subprocess

        self._send(b"done\n")
        self._sock.close()
        try:
            self.proc.wait(FINISH_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, not yet reaped: its pid is still its own
            self.proc.wait()
        for path in self.paths:
            shutil.rmtree(path, ignore_errors=True)


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def _end_rank(pidfd: int) -> None:
    """Kill the rank's whole group, if the rank is still alive (see the module's doc)."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
    except ProcessLookupError:
        return
    # Something else may kill it meanwhile (its own parent-death handler ends its group): then the
    # pidfd names no pid any more (0 or -1 in fdinfo, never a number to act on), or says it exited.
    pid = _pid_of(pidfd)
    if pid <= 0 or _exited(pidfd):
        return
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    if _exited(pidfd):
        return
    # Stopped and not exited: its pid, which is its group's id (it leads its own session), is its own.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pid_of(pidfd: int) -> int:
    """The pid the pidfd names; 0 or less once that process is gone."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return 0


def main(argv: list[str]) -> int:
    task_pid, paths = int(argv[0]), [argv[1]]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        task = os.pidfd_open(task_pid)
    except ProcessLookupError:
        task = None  # the task died before this process got this far (a loaded machine starts it slowly)
    rank: int | None = None
    sock = socket.socket(fileno=os.dup(0))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    pending = b""

    def take(data: bytes, fds: list[int]) -> bool:
        """What the task said; True once it said done."""
        nonlocal rank, pending
        if fds:
            rank = fds[0]
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"done":
                return True
            if line.startswith(b"own "):
                paths.append(os.fsdecode(line[4:]))
        return False

    # The pidfd names the task only while the task is still this process's parent: a process that
    # took a dead task's pid is not.
    task_gone = task is None or os.getppid() != task_pid
    while not task_gone:
        ready = select.select([task, sock], [], [])[0]
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
            if not data:
                # The task closed its end without saying done: it is dying (then its pidfd says so
                # within moments), or it dropped its handle while it lives on, and then what the
                # rank owns is still the task's to remove.
                task_gone = bool(select.select([task], [], [], FINISH_TIMEOUT)[0])
                if not task_gone:
                    return 0
                break
            if take(data, fds):
                return 0
        if task in ready:
            task_gone = True
    # The task is gone: what it said before it died may still be unread.
    sock.setblocking(False)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        except (BlockingIOError, OSError):
            break
        if not data and not fds:
            break
        if take(data, fds):
            return 0
    try:
        if rank is not None:
            _end_rank(rank)
    finally:  # whatever became of the rank, what it owned goes
        import shutil

        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
