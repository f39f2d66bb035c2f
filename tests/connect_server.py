"""A Spark Connect server in its own process, for tests whose client must not be the driver.

Started with pyspark's own ``spark-submit`` and the Connect server class, on a free port of
127.0.0.1; its executors run this interpreter and can import tests/helpers.py. Stopped, with its
whole process group, when the test module ends.
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest

from conftest import jvm_conf
from storage_servers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
#: The class Spark loads to serve Connect, in the embedded server and in a server of its own.
PLUGIN = "org.apache.spark.sql.connect.SparkConnectPlugin"


@functools.lru_cache(maxsize=None)
def server_missing() -> str | None:
    """Why this pyspark cannot serve Spark Connect, or None when it can.

    pyspark 4's wheel carries the server (``jars/spark-connect_2.13-*.jar``); pyspark 3.5's does
    not: there the server is the separate package ``org.apache.spark:spark-connect_2.12:3.5.x``,
    fetched from Maven by ``--packages`` (docs/connect.md), which the tests never do. Told by the
    plugin class in the jars that pyspark's ``spark-submit`` loads, not by the version.
    """
    import pyspark

    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    entry = PLUGIN.replace(".", "/") + ".class"
    names = sorted(os.listdir(jars)) if os.path.isdir(jars) else []
    for name in sorted(names, key=lambda n: "connect" not in n):  # the likely jar first
        try:
            with zipfile.ZipFile(os.path.join(jars, name)) as jar:
                jar.getinfo(entry)
                return None
        except (KeyError, OSError, zipfile.BadZipFile):
            continue
    scala = next((n[len("spark-core_"):].split("-")[0] for n in names if n.startswith("spark-core_")), "2.12")
    return (f"pyspark {pyspark.__version__} has no Spark Connect server: no jar under {jars} holds {PLUGIN}. "
            f"It is the separate package org.apache.spark:spark-connect_{scala}:{pyspark.__version__} "
            "(docs/connect.md), which the tests do not download")


#: Marks a test that needs a Connect server (the embedded one or a process of its own).
needs_server = pytest.mark.skipif(server_missing() is not None, reason=str(server_missing()))


class ConnectServer:
    """``spark-submit --class ...SparkConnectServer`` on ``master``; ``url`` is its ``sc://`` address.
    ``host``: the address it listens on (the simulated hosts' bridge, for the multi-host tier)."""

    def __init__(self, master: str = "local[3]", timeout: float = 180.0, conf: dict | None = None,
                 host: str = "127.0.0.1"):
        import pyspark

        self.host = host
        self.port = free_port(host)
        self.url = f"sc://{host}:{self.port}"
        home = os.path.dirname(pyspark.__file__)
        env = dict(os.environ, SPARK_HOME=home, PYSPARK_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join([HERE, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p]]))
        for key in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE",
                    "SPARK_CONNECT_AUTHENTICATE_TOKEN"):
            env.pop(key, None)
        self.log = tempfile.NamedTemporaryFile(prefix="connect-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [os.path.join(home, "bin", "spark-submit"), "--master", master,
             "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
             "--conf", f"spark.connect.grpc.binding.port={self.port}",
             "--conf", f"spark.connect.grpc.binding.address={host}",
             "--conf", "spark.ui.enabled=false", "--conf", "spark.ui.showConsoleProgress=false",
             *[arg for k, v in {**jvm_conf(), **(conf or {})}.items() for arg in ("--conf", f"{k}={v}")]],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Connect server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"the Connect server did not listen on {self.port} within {timeout} s:\n"
                                       f"{self.output()[-3000:]}")
                time.sleep(0.2)  # a JVM's listening socket has no event a test can await

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def driver_pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()
        os.unlink(self.log.name)
