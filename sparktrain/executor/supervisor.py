"""The lifecycle of one rank's process.

The rank runs in its own session and process group, so it and anything it starts can be
stopped together. It dies with its task in two ways: a parent-death signal set right after
exec (see child.py), and the rank's watcher (see watcher.py), which acts if the task dies.

Stopping is terminate, a grace period, then kill, of the whole group. The task never signals
a group it cannot prove is the rank's: it does not reap the rank (``waitpid``) until the group
is dead, and a process that has not been reaped keeps its pid, which is its group's id, from
being reused. It learns that the rank exited from a pidfd, which does not reap.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from . import child as _child


def _group_members(pgid: int) -> bool:
    """Whether a live process other than the group's leader is in group ``pgid``.

    Read from /proc, not by signalling: the leader, exited but not reaped, answers a signal too.
    """
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == pgid:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ChildProcess:
    """A supervised rank process: ``python -m sparktrain.executor.child WORKDIR PARENT_PID``.

    stdout and stderr are pipes the caller reads; stdin is ``/dev/null``. :attr:`pidfd` names the
    process for as long as this object lives (hand it to the rank's watcher). :meth:`request_stacks`
    makes the process write every thread's Python stack to :attr:`stacks`, a non-blocking pipe.

    Held (``held=True``), it starts its interpreter and waits, having read nothing of the user's,
    until :meth:`go` gives it its whole environment: the caller starts it while the ranks meet.
    """

    def __init__(self, workdir: str, env: Mapping[str, str], *, python: str | None = None,
                 extra_args: Sequence[str] = (), held: bool = False):
        argv = [python or sys.executable, "-m", _child.__name__, workdir, str(os.getpid()), *extra_args]
        go_read = None
        #: Held: the write end of the pipe the child waits on before it runs anything of the user's
        #: (see :meth:`go`); None once the child was let go, or for a child never held.
        self._go: int | None = None
        #: The go pipe's identity, so that :meth:`go` never writes into a descriptor that was closed
        #: behind its back and reused for another file.
        self._go_inode: tuple[int, int] | None = None
        #: Where the child writes its threads' stacks when asked (:meth:`request_stacks`). Its end
        #: does not block: a stack nobody reads is cut short, never a rank stuck in its handler.
        self.stacks, stacks_write = os.pipe()
        os.set_blocking(self.stacks, False)
        os.set_blocking(stacks_write, False)
        argv += ["--stacks", str(stacks_write)]
        if held:
            go_read, self._go = os.pipe()
            st = os.fstat(self._go)
            self._go_inode = (st.st_dev, st.st_ino)
            argv += ["--go", str(go_read)]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own session and process group: pgid == pid
                close_fds=True,
                pass_fds=(stacks_write,) + ((go_read,) if go_read is not None else ()),
            )
        except BaseException:
            os.close(self.stacks)
            if self._go is not None:
                os.close(self._go)
            raise
        finally:
            os.close(stacks_write)
            if go_read is not None:
                os.close(go_read)
        self.pid = self.proc.pid
        self.pgid = self.proc.pid
        #: Opened before anything can reap the child: it names this process, never a successor.
        self.pidfd = os.pidfd_open(self.pid)
        self.workdir = workdir
        #: Whether :meth:`stop` sent SIGKILL while the child still ran (see :attr:`killed_elsewhere`).
        self._killed_here = False

    def go(self, env: Mapping[str, str]) -> bool:
        """Let a held child run with ``env``, the rank's whole environment, built once: it takes it
        as its own, then loads and calls the payload as an unheld child would.

        Returns whether the child took the go; when it did not (it died meanwhile, or its pipe is
        not what it was), the caller starts a fresh child. A child whose go pipe closes without a
        go exits with ``EXIT_NOT_LET_GO`` having run nothing.
        """
        if self._go is None:
            raise RuntimeError("this child is not held")
        fd, self._go = self._go, None
        try:
            st = os.fstat(fd)
        except OSError:
            return False  # closed behind our back: the child saw EOF and ran nothing
        if (st.st_dev, st.st_ino) != self._go_inode:
            return False  # the number now names another file: never write there, never close it
        try:
            if self.exited():
                return False
            view = memoryview(json.dumps({"env": dict(env)}).encode())
            while view:
                view = view[os.write(fd, view):]
            return True
        except BrokenPipeError:
            return False  # the child is gone
        finally:
            os.close(fd)

    @property
    def stdout(self):
        return self.proc.stdout

    @property
    def stderr(self):
        return self.proc.stderr

    def exited(self, timeout: float = 0.0) -> bool:
        """Whether the child has exited (waiting up to ``timeout`` s); it stays unreaped."""
        return bool(select.select([self.pidfd], [], [], timeout)[0])

    def request_stacks(self) -> bool:
        """Ask the child for its threads' stacks (SIGUSR1, through the pidfd: never a stranger).
        False when it has exited."""
        if self.pidfd < 0 or self.exited():
            return False
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGUSR1)
            return True
        except ProcessLookupError:
            return False

    def stop(self, grace: float) -> int:
        """Terminate the whole group, wait up to ``grace`` seconds, then kill what is left.

        Returns the child's exit code (negative: killed by that signal).
        """
        if self.proc.returncode is None:  # not reaped: the group's id is still the rank's own
            _signal_group(self.pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            self.exited(grace)
            # The descendants have no exit event to await, so poll, briefly at first.
            pause = 0.002
            while (not self.exited() or _group_members(self.pgid)) and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            self._killed_here = self._killed_here or not self.exited()
            _signal_group(self.pgid, signal.SIGKILL)
        return self._finish()

    @property
    def killed_elsewhere(self) -> bool:
        """Whether the reaped child died of a SIGKILL that :meth:`stop` did not send: the kernel's OOM
        killer's, or a user's. That is the rank's own failure, even where a stop reached its task
        first (a killed process's sockets close a moment before its exit shows)."""
        return self.proc.returncode == -signal.SIGKILL and not self._killed_here

    def reap(self, grace: float) -> int:
        """After the child closed its output: wait for its exit, then end what it left in its group.

        A child that closed its pipes but does not exit within ``grace`` is stopped.
        """
        if not self.exited(grace) or _group_members(self.pgid):
            return self.stop(grace)
        return self._finish()

    def _finish(self) -> int:
        return self.proc.wait()

    def close_pipes(self) -> None:
        """Close the go pipe (a held child never let go exits) and the output pipes.

        The pidfd stays open while the rank's watcher may still be handed it; it closes with
        :meth:`close`."""
        if self._go is not None:
            os.close(self._go)
            self._go = None
        if self.stacks >= 0:
            os.close(self.stacks)
            self.stacks = -1
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Close everything, the pidfd included. The child must have been reaped or be ended elsewhere."""
        self.close_pipes()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
