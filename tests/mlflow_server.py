"""A real ``mlflow server`` for the tests: sqlite backend and local artifacts in a temporary directory.

The ``mlflow_server`` fixture starts it on 127.0.0.1 with a free port, waits until its ``/health``
endpoint answers (a bounded poll: no event says "the server is up"), and stops it at the end.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from storage_servers import free_port

#: Seconds the server may take to create its database and answer; generous for a loaded 2-core machine.
START_DEADLINE = 120.0


class MlflowServer:
    """``host``: the address it listens on (the simulated hosts' bridge, for the multi-host tier)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = free_port(host)
        self.workdir = tempfile.mkdtemp(prefix="mlflow-server-")
        self.uri = f"http://{host}:{self.port}"
        self.log_path = os.path.join(self.workdir, "server.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", self.host, "--port", str(self.port),
                 "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{os.path.join(self.workdir, 'mlflow.db')}",
                 "--artifacts-destination", os.path.join(self.workdir, "artifacts")],
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # Its job runner (not used here) keeps a queue in a /dev/shm directory that outlives the server.
                env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"), start_new_session=True)
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)  # no event for "the server answers"; bounded poll
        self.stop()
        raise TimeoutError(f"mlflow server did not answer {self.uri}/health within {START_DEADLINE:g} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the server's own workers are in its group
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def mlflow_server():
    pytest.importorskip("mlflow")
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    server = MlflowServer()
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.workdir, ignore_errors=True)
    # The native engine's own segments (sparktrain-*) are other tests' business: another test
    # process may be running a rank while this module ends.
    left = {n for n in (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) - shm_before
            if not n.startswith("sparktrain-")}
    assert not left, f"the mlflow server left {sorted(left)} in /dev/shm"
