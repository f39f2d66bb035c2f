"""A Spark standalone cluster on simulated hosts (tests/simhosts.py): the master in the driver's
namespace, one worker per host, from the pip pyspark's ``bin/spark-class``.

By hand, to try things::

    sudo .venv/bin/python tests/standalone.py --hosts 2 --ranks-per-host 2

prints the master's URL and the driver's address, and tears everything down on Ctrl-C.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from simhosts import SimHosts, why_not
from storage_servers import free_port


def _die_with_this_process() -> None:
    """In the master's child before it execs: SIGKILL when the process that started it dies, so a
    test process killed before its teardown leaves no master behind (workers go with their hosts)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class Standalone:
    """A Spark standalone master in the driver's namespace and one worker per simulated host, from
    the pip pyspark's ``bin/spark-class``."""

    def __init__(self, hosts: SimHosts, cores: int = 2, memory: str = "2g", gpus: int = 0, log_dir: str | None = None):
        import pyspark

        self.hosts, self.cores, self.memory, self.gpus = hosts, cores, memory, gpus
        self.spark_home = os.path.dirname(pyspark.__file__)
        self.log_dir = log_dir or os.path.join(hosts.root, "logs")
        self.port = free_port(hosts.driver_ip)
        self.ui_port = free_port(hosts.driver_ip)
        self.url = f"spark://{hosts.driver_ip}:{self.port}"
        self.master: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = [None] * hosts.n

    def _env(self, extra: dict) -> dict:
        env = dict(os.environ, SPARK_HOME=self.spark_home, PYSPARK_PYTHON=sys.executable,
                   SPARK_NO_DAEMONIZE="1", **extra)
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join([here, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        return env

    def start(self, timeout: float = 120.0) -> "Standalone":
        os.makedirs(self.log_dir, exist_ok=True)
        spark_class = os.path.join(self.spark_home, "bin", "spark-class")
        try:
            with open(os.path.join(self.log_dir, "master.log"), "wb") as log:
                self.master = subprocess.Popen(
                    [spark_class, "org.apache.spark.deploy.master.Master", "--host", self.hosts.driver_ip,
                     "--port", str(self.port), "--webui-port", str(self.ui_port)],
                    env=self._env({}), stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_this_process)
            for i in range(self.hosts.n):
                self.start_worker(i)
            self.wait_for_workers(self.hosts.n, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, i: int) -> None:
        """Start host ``i``'s worker (again, after ``kill_host``: the old one is reaped first)."""
        old = self.workers[i]
        if old is not None:
            self.hosts.kill_host(i)
            with contextlib.suppress(subprocess.TimeoutExpired):
                old.wait(10)
        home = self.hosts.home(i)
        opts = ["-Dspark.decommission.enabled=true"]  # SIGPWR makes the worker leave in good order
        if self.gpus:
            script = os.path.join(home, "gpus.sh")
            with open(script, "w") as f:
                addresses = ",".join(f'"{g}"' for g in range(self.gpus))
                f.write(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": [{addresses}]}}'\n")
            os.chmod(script, 0o755)
            opts += [f"-Dspark.worker.resource.gpu.amount={self.gpus}",
                     f"-Dspark.worker.resource.gpu.discoveryScript={script}"]
        env = self._env({"SPARK_LOCAL_DIRS": os.path.join(home, "local"),
                         "SPARK_WORKER_DIR": os.path.join(home, "work"),
                         "SPARK_LOCAL_IP": self.hosts.ips[i], "SPARK_WORKER_OPTS": " ".join(opts)})
        spark_class = os.path.join(self.spark_home, "bin", "spark-class")
        with open(os.path.join(self.log_dir, f"worker-{i}.log"), "ab") as log:
            self.workers[i] = self.hosts.popen(
                i, [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", self.hosts.ips[i],
                    "--cores", str(self.cores), "--memory", self.memory, "--webui-port", "8081",
                    "--work-dir", os.path.join(home, "work"), self.url],
                env=env, stdout=log, stderr=subprocess.STDOUT)

    def decommission(self, i: int) -> None:
        """Tell host ``i``'s worker to leave, as a cloud's notice does: SIGPWR, which a worker with
        spark.decommission.enabled answers by decommissioning itself and its executors."""
        worker = self.workers[i]
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGPWR)  # our child, not yet reaped: its pid is still its own

    def alive_workers(self) -> int:
        """How many workers the master counts as alive (its web UI's JSON)."""
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.hosts.driver_ip}:{self.ui_port}/json/", timeout=2) as r:
                return int(json.load(r).get("aliveworkers", 0))
        except (OSError, ValueError):
            return 0

    def wait_for_workers(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_workers() < n:
            if self.master is not None and self.master.poll() is not None:
                raise RuntimeError(f"the standalone master exited ({self.master.returncode}); see {self.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.alive_workers()} of {n} workers registered within {timeout:g} s; "
                                   f"see {self.log_dir}")
            time.sleep(0.2)  # the master announces no registration; bounded poll of its state

    def stop(self) -> None:
        for i in range(self.hosts.n):
            self.hosts.kill_host(i)
            if self.workers[i] is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.workers[i].wait(10)
        if self.master is not None and self.master.poll() is None:
            os.killpg(self.master.pid, signal.SIGTERM)  # our child, not yet reaped: its pid is still its own
            try:
                self.master.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.master.pid, signal.SIGKILL)
                self.master.wait(10)

    def session_conf(self, cores_max: int | None = None, **conf) -> dict:
        """The settings of a driver SparkSession for this cluster."""
        out = {"spark.driver.host": self.hosts.driver_ip, "spark.driver.bindAddress": self.hosts.driver_ip,
               "spark.executor.memory": "1g", "spark.cores.max": str(cores_max or self.cores * self.hosts.n),
               "spark.executor.cores": str(self.cores), "spark.task.cpus": "1",
               "spark.decommission.enabled": "true"}
        out.update(conf)
        return out


@contextlib.contextmanager
def cluster_session(hosts: int, cores: int, wait: float = 120.0):
    """``n`` simulated hosts, a standalone cluster of ``cores`` per worker on them, and a driver
    SparkSession in this process whose executors have all registered: yields ``(SimHosts,
    Standalone, session)``; stops and removes everything after, raising if anything is left."""
    from conftest import make_spark, stop_spark

    from sparktrain.driver.launch import cluster as capacity

    sim = SimHosts(hosts).up()
    standalone = session = None
    try:
        standalone = Standalone(sim, cores=cores).start()
        conf = standalone.session_conf()
        session = make_spark(standalone.url, **conf)
        found = capacity.wait_for_executors(session.sparkContext, conf, lambda c: c.executors >= hosts, wait)
        if found.executors < hosts:
            raise RuntimeError(f"only {found.executors} executors registered; see {standalone.log_dir}")
        yield sim, standalone, session
    finally:
        if session is not None:
            stop_spark(session)
        if standalone is not None:
            standalone.stop()
        left = sim.down()
    if left:
        raise RuntimeError("left behind: " + "; ".join(left))


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description="Bring up simulated hosts and a Spark standalone cluster on them.")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2, help="worker cores")
    p.add_argument("--gpus", type=int, default=0, help="fake GPUs per worker")
    args = p.parse_args()
    reason = why_not()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    hosts = SimHosts(args.hosts).up()
    cluster = None
    try:
        cluster = Standalone(hosts, cores=args.ranks_per_host, gpus=args.gpus).start()
        print(f"master {cluster.url}; driver address {hosts.driver_ip}; hosts {', '.join(hosts.ips)}")
        print("spark conf: " + " ".join(f"--conf {k}={v}" for k, v in cluster.session_conf().items()))
        print(f"logs in {cluster.log_dir}; Ctrl-C tears everything down")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        if cluster is not None:
            cluster.stop()
        left = hosts.down()
        if left:
            print("left behind: " + "; ".join(left), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
