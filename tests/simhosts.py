"""Simulated hosts on one machine, and a Spark standalone cluster on them.

Each simulated host is a set of namespaces and a cgroup, as root:
- its own network namespace, with a veth pair to a bridge in the driver's namespace and an
  address of its own on the bridge's subnet;
- its own hostname (a UTS namespace) and ``/etc/hosts`` naming every host (a worker whose
  hostname does not resolve hangs without a word);
- its own ``/dev/shm``, a private tmpfs in a mount namespace of its own;
- its own core where the machine has enough (a cgroup v1 cpuset; with more hosts than cores
  they share), and its own Spark local and work directories.

Every process of a host runs in its cpuset cgroup, so stopping a host ends exactly the processes
in that cgroup: nothing is signalled that was not started inside it. ``down()`` leaves no
process, namespace, veth, bridge, cgroup or directory behind.

Links can be shaped (``shape``: a tbf qdisc on both ends of the veth) and cut silently
(``cut``: the bridge side down, so no reset reaches anyone).

By hand, to try things::

    sudo .venv/bin/python tests/simhosts.py --hosts 2 --ranks-per-host 2

prints the master's URL and the driver's address, and tears everything down on Ctrl-C.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

CPUSET = "/sys/fs/cgroup/cpuset"


def why_not() -> str | None:
    """Why simulated hosts cannot run here, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, mounts, cgroups)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the {tool!r} command"
    if not os.path.isdir(CPUSET):
        return f"simulated hosts need the cgroup v1 cpuset controller at {CPUSET}"
    probe = f"stp{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _in_cgroup(pid: int, cgroup: str) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return any(line.split(":", 2)[1] == "cpuset" and line.rstrip("\n").split(":", 2)[2] == cgroup
                       for line in f)
    except (OSError, IndexError):
        return False


class SimHosts:
    """``n`` simulated hosts on a bridge; the driver's namespace holds the bridge's address."""

    def __init__(self, n: int, workdir: str | None = None):
        self.n = n
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:], 16)}"
        self.bridge = f"stb{self.tag}"
        self.driver_ip = f"{self.subnet}.1"
        self.ips = [f"{self.subnet}.{10 + i}" for i in range(n)]
        self.names = [f"sim{self.tag}-h{i}" for i in range(n)]
        self.netns = [f"st{self.tag}h{i}" for i in range(n)]
        self.veths = [f"st{self.tag}h{i}" for i in range(n)]  # the bridge side; the host side is eth0
        self.cgroups = [f"sparktrain-sim-{self.tag}-h{i}" for i in range(n)]
        self.root = workdir or tempfile.mkdtemp(prefix=f"sparktrain-sim-{self.tag}-")
        self.cores = os.sched_getaffinity(0)
        self._up = False

    # -- bring up and down ------------------------------------------------------------------------

    def up(self) -> "SimHosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.driver_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            cores = sorted(self.cores)
            hosts_file = "".join(f"{ip} {name}\n" for ip, name in zip(self.ips, self.names))
            hosts_file = f"127.0.0.1 localhost\n{self.driver_ip} sim{self.tag}-driver\n" + hosts_file
            for i in range(self.n):
                ns, veth = self.netns[i], self.veths[i]
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                _ip("link", "set", f"{veth}p", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("netns", "exec", ns, "ip", "link", "set", f"{veth}p", "name", "eth0")
                _ip("netns", "exec", ns, "ip", "addr", "add", f"{self.ips[i]}/24", "dev", "eth0")
                _ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _ip("netns", "exec", ns, "ip", "route", "add", "default", "via", self.driver_ip)
                home = self.home(i)
                os.makedirs(os.path.join(home, "local"), exist_ok=True)
                os.makedirs(os.path.join(home, "work"), exist_ok=True)
                with open(os.path.join(home, "hosts"), "w") as f:
                    f.write(hosts_file)
                cg = os.path.join(CPUSET, self.cgroups[i])
                os.mkdir(cg)
                with open(os.path.join(CPUSET, "cpuset.mems")) as f:
                    mems = f.read().strip()
                with open(os.path.join(cg, "cpuset.mems"), "w") as f:
                    f.write(mems)
                with open(os.path.join(cg, "cpuset.cpus"), "w") as f:
                    f.write(str(cores[i % len(cores)]))
            self._up = True
        except BaseException:
            self.down()
            raise
        return self

    def home(self, i: int) -> str:
        return os.path.join(self.root, f"h{i}")

    def down(self) -> list[str]:
        """Ends every process of every host, then removes what ``up`` made. Returns what could
        not be removed (empty when all went)."""
        left = []
        for i in range(self.n):
            self.kill_host(i)
        for i in range(self.n):
            cg = os.path.join(CPUSET, self.cgroups[i])
            if os.path.isdir(cg):
                try:
                    os.rmdir(cg)
                except OSError as e:
                    left.append(f"cgroup {cg}: {e}")
            if _ip("netns", "del", self.netns[i], check=False).returncode and \
                    self.netns[i] in _ip("netns", "list", check=False).stdout:
                left.append(f"netns {self.netns[i]}")
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        self._up = False
        return left

    def processes(self, i: int) -> list[int]:
        """The pids in host ``i``'s cgroup."""
        try:
            with open(os.path.join(CPUSET, self.cgroups[i], "cgroup.procs")) as f:
                return [int(p) for p in f.read().split()]
        except FileNotFoundError:
            return []

    def kill_host(self, i: int, timeout: float = 20.0) -> None:
        """SIGKILLs every process in host ``i``'s cgroup, each through a pidfd taken while it was
        still a member (so a pid reused meanwhile is never signalled), until none is left."""
        cgroup = "/" + self.cgroups[i]
        deadline = time.monotonic() + timeout
        while (pids := self.processes(i)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    if _in_cgroup(pid, cgroup):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:
                    pass
                finally:
                    os.close(fd)
            time.sleep(0.05)  # the kernel empties cgroup.procs as they die; no event for it in v1

    # -- processes on a host ----------------------------------------------------------------------

    def popen(self, i: int, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Starts ``argv`` on host ``i``: in its cpuset, network, UTS and mount namespaces, with
        its hostname, ``/etc/hosts`` and a private ``/dev/shm``."""
        cg = os.path.join(CPUSET, self.cgroups[i], "cgroup.procs")
        script = ('hostname "$0" && mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && '
                  'mount --bind "$1" /etc/hosts && shift && exec "$@"')

        def join_cgroup():  # before `ip netns exec`, which remounts /sys
            with open(cg, "w") as f:
                f.write(str(os.getpid()))

        cmd = ["ip", "netns", "exec", self.netns[i], "unshare", "--uts", "--mount", "--propagation", "private",
               "sh", "-c", script, self.names[i], os.path.join(self.home(i), "hosts"), *argv]
        return subprocess.Popen(cmd, env=env, preexec_fn=join_cgroup, start_new_session=True, **kw)

    def shm(self, i: int, pid: int) -> list[str]:
        """What is in the /dev/shm of host ``i``'s process ``pid`` (each process started by
        ``popen`` has its own)."""
        if not _in_cgroup(pid, "/" + self.cgroups[i]):
            raise ValueError(f"pid {pid} is not a process of host {i}")
        out = subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "ls", "-A", "/dev/shm"], capture_output=True,
                             text=True, check=True, timeout=10)
        return out.stdout.split()

    def run(self, i: int, argv: list[str], timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        proc = self.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    # -- links --------------------------------------------------------------------------------------

    def shape(self, i: int, rate: str = "1gbit") -> None:
        """Shape host ``i``'s link to ``rate``, both ways."""
        for args in (["tc"], ["ip", "netns", "exec", self.netns[i], "tc"]):
            dev = self.veths[i] if len(args) == 1 else "eth0"
            subprocess.run([*args, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                            "latency", "50ms"], check=True, capture_output=True)

    def unshape(self, i: int) -> None:
        for args in (["tc"], ["ip", "netns", "exec", self.netns[i], "tc"]):
            dev = self.veths[i] if len(args) == 1 else "eth0"
            subprocess.run([*args, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def cut(self, i: int) -> None:
        """A silent partition: host ``i``'s link goes down on the bridge side; no reset reaches anyone."""
        _ip("link", "set", self.veths[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "up")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
                    stderr=subprocess.STDOUT, start_new_session=True)
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
