"""The lifecycle of one rank's child process.

The child runs in its own session and process group, so it and anything it starts can be
stopped together. It dies with its parent in two ways (see child.py): a parent-death signal
set right after exec, and a watcher process that watches this end's pipe and the parent pid.
Stopping is terminate, a grace period, then kill, of the whole group.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from . import child as _child


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ChildProcess:
    """A supervised child: ``python -m sparktrain.executor.child WORKDIR PARENT_PID``.

    stdout and stderr are pipes the caller reads; stdin is the lifeline, held open until
    :meth:`stop`, so the child sees EOF (and kills its group) the moment this process dies.
    The caller removes WORKDIR when it is done with the child's files: the child's watcher
    waits for that, and removes it itself if this process dies first.
    """

    def __init__(self, workdir: str, env: Mapping[str, str], *, python: str | None = None,
                 extra_args: Sequence[str] = (), held: bool = False):
        argv = [python or sys.executable, "-m", _child.__name__, workdir, str(os.getpid()), *extra_args]
        go_read = None
        #: Held (``held=True``): the write end of the pipe the child waits on before it runs anything
        #: of the user's (see :meth:`go`); None once the child was let go, or for a child never held.
        self._go: int | None = None
        #: The go pipe's identity, so that :meth:`go` never writes into a descriptor that was closed
        #: behind its back and reused for another file.
        self._go_inode: tuple[int, int] | None = None
        if held:
            go_read, self._go = os.pipe()
            st = os.fstat(self._go)
            self._go_inode = (st.st_dev, st.st_ino)
            argv += ["--go", str(go_read)]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=dict(env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own session and process group: pgid == pid
                close_fds=True,
                pass_fds=(go_read,) if go_read is not None else (),
            )
        except BaseException:
            if self._go is not None:
                os.close(self._go)
            raise
        finally:
            if go_read is not None:
                os.close(go_read)
        self.pid = self.proc.pid
        self.pgid = self.proc.pid
        #: What the child was started with: a held child keeps them until :meth:`go` changes them.
        self.workdir = workdir
        self.env = dict(env)

    def move(self, workdir: str) -> None:
        """Tell a held child's watcher that the child's files will be in ``workdir`` from now on, so it
        watches that directory instead and removes it too if this process dies; the child itself
        learns it with its go (``go(..., workdir=workdir)``). Says nothing to a child that is gone."""
        try:
            self.proc.stdin.write(os.fsencode(workdir) + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # gone (or stopped): go() says so

    def go(self, env_changes: Mapping[str, str | None], workdir: str | None = None) -> bool:
        """Let a held child run: it applies ``env_changes`` to its environment (None removes a
        variable), moves to ``workdir`` when given (see :meth:`move`), then loads and calls the
        payload as an unheld child would. Returns whether the
        child took the go; when it did not (it died meanwhile, or its pipe is not what it was), the
        caller releases it and starts a fresh child.

        A held child has started its interpreter, imported what it needs and installed its lifeline,
        but has read nothing of the user's: the caller starts it early (while the ranks meet) and
        says go once it knows the rest of the rank's environment.
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
            if self.proc.poll() is not None:
                return False
            data = json.dumps({"env": dict(env_changes), "workdir": workdir}).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            return True
        except BrokenPipeError:
            return False  # the child is gone
        finally:
            os.close(fd)

    def release(self, grace: float) -> int:
        """A held child that is not needed: it exits without running anything; returns its exit code."""
        if self._go is not None:
            os.close(self._go)  # EOF instead of go: the child exits at once
            self._go = None
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        code = self.stop(grace)
        self.close_pipes()
        return code

    @property
    def stdout(self):
        return self.proc.stdout

    @property
    def stderr(self):
        return self.proc.stderr

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float) -> int:
        """Terminate the whole group, wait up to ``grace`` seconds, then kill what is left.

        Returns the child's exit code (negative: killed by that signal).
        """
        if self.proc.poll() is None or _group_alive(self.pgid):
            _signal_group(self.pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            # The child itself is reaped; its descendants have no exit event we can await, so poll,
            # briefly at first: the rank's watcher usually leaves the group within milliseconds.
            pause = 0.002
            while _group_alive(self.pgid) and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            _signal_group(self.pgid, signal.SIGKILL)
        return self._finish()

    def reap(self, grace: float) -> int:
        """After the child closed its output: wait for its exit, then end what it left in its group.

        A child that closed its pipes but does not exit within ``grace`` is stopped.
        """
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return self.stop(grace)
        if _group_alive(self.pgid):
            return self.stop(grace)
        return self._finish()

    def _finish(self) -> int:
        code = self.proc.wait()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        return code

    def close_pipes(self) -> None:
        if self._go is not None:
            os.close(self._go)  # a held child never let go exits
            self._go = None
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:
                    pass
