"""A process that removes a directory once the process that made it is gone.

The barrier task starts one for its data spool before it reads a single row. It holds the read
end of a pipe whose write end only the task has; EOF arrives when the task closes it or dies,
even by SIGKILL (Spark kills a cancelled task's Python worker that way), and then the directory
goes. It runs in its own session, so signals to the task's process group do not reach it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys


class Janitor:
    """``python -m sparktrain.executor.janitor PATH``, fed by a pipe this process holds."""

    def __init__(self, path: str):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, path], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True)

    def finish(self, timeout: float = 10.0) -> None:
        """The task is done with the directory: the janitor removes what is left and exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            shutil.rmtree(self.path, ignore_errors=True)


def main(argv: list[str]) -> int:
    path = argv[0]
    try:
        while sys.stdin.buffer.read(4096):
            pass  # nothing is ever written; this waits for EOF
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
