"""Simulated hosts on one machine (a Spark standalone cluster on them: tests/standalone.py).

Each simulated host is a set of namespaces and a cgroup, as root:
- its own network namespace, with a veth pair to a bridge in the driver's namespace and an
  address of its own on the bridge's subnet (``eth0``); and a second network, as hosts with a
  separate data network have: another veth pair (``eth1``) to a second bridge and subnet, which
  carries only what is sent to its addresses (``data_ips``, ``data_driver_ip``);
- its own hostname (a UTS namespace) and ``/etc/hosts`` naming every host (a worker whose
  hostname does not resolve hangs without a word);
- its own ``/dev/shm``, a private tmpfs in a mount namespace of its own;
- its own core where the machine has enough (a cgroup v1 cpuset; with more hosts than cores
  they share), and its own Spark local and work directories.

Every process of a host runs in its cpuset cgroup, so stopping a host ends exactly the processes
in that cgroup: nothing is signalled that was not started inside it. ``down()`` leaves no
process, namespace, veth, bridge, cgroup or directory behind.

A test process killed before its teardown (SIGKILL, a timeout's kill) leaves its hosts up: each
set records its owner (pid and start time) under ``RECORDS`` while it is up, and the next ``up()``
takes down every set whose owner is gone, by its recorded names; a set whose owner still runs is
never touched.

Links can be shaped (``shape``: a tbf qdisc on both ends of the veth) and cut silently
(``cut``: the bridge side down, so no reset reaches anyone).

To bring hosts and a cluster up by hand: ``tests/standalone.py``.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

CPUSET = "/sys/fs/cgroup/cpuset"
#: One file per set of hosts that is up: its tag, owner and root (see the module's docstring).
RECORDS = os.path.join(tempfile.gettempdir(), "sparktrain-sim-records")


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


def _stat_field(pid: int, index: int) -> str | None:
    """Field ``index`` of /proc/PID/stat after the command's name (0: the state), or None if there
    is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is no such process:
    with the pid, it names one process for good."""
    return _stat_field(pid, 19)


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter (``Z`` for a zombie), or None if there is no such process."""
    return _stat_field(pid, 0)


def sweep_leftovers() -> list[str]:
    """Takes down every set of hosts whose recorded owner is gone; returns their tags."""
    swept = []
    for name in sorted(os.listdir(RECORDS)) if os.path.isdir(RECORDS) else []:
        path = os.path.join(RECORDS, name)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if _started(record["owner"]) == record["started"]:
            continue  # its owner runs: the hosts are in use
        SimHosts(record["n"], workdir=record["root"], tag=record["tag"]).down()
        swept.append(record["tag"])
    return swept


class SimHosts:
    """``n`` simulated hosts on a bridge; the driver's namespace holds the bridge's address."""

    def __init__(self, n: int, workdir: str | None = None, share_cores: bool = False, tag: str | None = None):
        """``share_cores``: every host may use every core of the machine (for measurements that
        ask what more cores per host would give), instead of one core each. ``tag``: the names of
        a set that is up already (``sweep_leftovers``); a new set draws its own."""
        self.n = n
        self.share_cores = share_cores
        self.tag = tag or secrets.token_hex(2)
        self.subnet = f"10.{200 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:], 16)}"
        self.bridge = f"stb{self.tag}"
        self.driver_ip = f"{self.subnet}.1"
        self.ips = [f"{self.subnet}.{10 + i}" for i in range(n)]
        self.names = [f"sim{self.tag}-h{i}" for i in range(n)]
        self.netns = [f"st{self.tag}h{i}" for i in range(n)]
        self.veths = [f"st{self.tag}h{i}" for i in range(n)]  # the bridge side; the host side is eth0
        # The second network: its own bridge and subnet; the host side is eth1.
        self.data_subnet = f"10.{150 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:], 16)}"
        self.data_bridge = f"std{self.tag}"
        self.data_driver_ip = f"{self.data_subnet}.1"
        self.data_ips = [f"{self.data_subnet}.{10 + i}" for i in range(n)]
        self.data_veths = [f"st{self.tag}d{i}" for i in range(n)]
        self.cgroups = [f"sparktrain-sim-{self.tag}-h{i}" for i in range(n)]
        self.root = workdir or tempfile.mkdtemp(prefix=f"sparktrain-sim-{self.tag}-")
        self.cores = os.sched_getaffinity(0)
        self._up = False

    # -- bring up and down ------------------------------------------------------------------------

    def up(self) -> "SimHosts":
        sweep_leftovers()
        os.makedirs(RECORDS, exist_ok=True)
        record = {"tag": self.tag, "n": self.n, "root": self.root, "owner": os.getpid(),
                  "started": _started(os.getpid())}
        with open(self._record, "w") as f:  # before anything is made: a kill half-way is swept too
            json.dump(record, f)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.driver_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            _ip("link", "add", self.data_bridge, "type", "bridge")
            _ip("addr", "add", f"{self.data_driver_ip}/24", "dev", self.data_bridge)
            _ip("link", "set", self.data_bridge, "up")
            cores = sorted(self.cores)
            hosts_file = "".join(f"{ip} {name}\n" for ip, name in zip(self.ips, self.names))
            hosts_file = f"127.0.0.1 localhost\n{self.driver_ip} sim{self.tag}-driver\n" + hosts_file
            for i in range(self.n):
                ns = self.netns[i]
                _ip("netns", "add", ns)
                self._link(ns, self.veths[i], self.bridge, "eth0", self.ips[i])
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _ip("netns", "exec", ns, "ip", "route", "add", "default", "via", self.driver_ip)
                self._link(ns, self.data_veths[i], self.data_bridge, "eth1", self.data_ips[i])
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
                    f.write(",".join(map(str, cores)) if self.share_cores else str(cores[i % len(cores)]))
            self._up = True
        except BaseException:
            self.down()
            raise
        return self

    @staticmethod
    def _link(ns: str, veth: str, bridge: str, name: str, address: str) -> None:
        """A veth pair from ``bridge`` into namespace ``ns``, named ``name`` there, with ``address``/24."""
        _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        _ip("link", "set", f"{veth}p", "netns", ns)
        _ip("link", "set", veth, "master", bridge)
        _ip("link", "set", veth, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", f"{veth}p", "name", name)
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", name)
        _ip("netns", "exec", ns, "ip", "link", "set", name, "up")

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
        for link in (*self.veths, *self.data_veths, self.bridge, self.data_bridge):  # gone with a netns, unless
            _ip("link", "del", link, check=False)                                      # up() stopped half-way
        shutil.rmtree(self.root, ignore_errors=True)
        self._up = False
        if not left:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._record)
        return left

    @property
    def _record(self) -> str:
        return os.path.join(RECORDS, f"{self.tag}.json")

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

    def shape_all(self, rate: str) -> None:
        """Every host's link at ``rate`` (as :meth:`shape`), or unshaped where ``rate`` is ``"none"``."""
        for i in range(self.n):
            if rate == "none":
                self.unshape(i)
            else:
                self.shape(i, rate)

    def cut(self, i: int) -> None:
        """A silent partition: host ``i``'s link goes down on the bridge side; no reset reaches anyone."""
        _ip("link", "set", self.veths[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "up")

    def bytes_sent(self, i: int, network: str = "data") -> int:
        """Bytes host ``i`` has sent on a network ("data": eth1's; "main": eth0's), counted at the
        bridge's side of its veth, which receives them."""
        veth = (self.data_veths if network == "data" else self.veths)[i]
        with open(f"/sys/class/net/{veth}/statistics/rx_bytes") as f:
            return int(f.read())
