"""Many simulated ranks against the real driver, without Spark: the rank side of a run's channel.

A few processes (:class:`SimJob` starts them) each play many ranks on one ``selectors`` loop, every
rank speaking the real protocol over its own TCP connection (``sparktrain.seam.channel``: the run's
secret, encrypted or not). The driver side is the real one: :class:`SimJob` is the job an attempt
(``sparktrain.driver.supervise.attempt.Attempt``) waits on, in place of the Spark stage, so the real
``DriverServer``, supervision core, stall watch and display handle everything the ranks send.

A rank checks in (hello), waits for the peers, then beats every second, and does what the
process is told on its stdin, one JSON object a line:

- ``{"cmd": "print", "lines": L}``: each rank sends ``L`` output lines, as fast as the driver takes them;
- ``{"cmd": "stall", "n": n, "late": [r, ...]}``: every rank but the late ones waits in collective
  ``n`` (its beats say so); the late ones are still before it, and answer a request for stacks;
- ``{"cmd": "fail", "rank": r}``: rank ``r`` reports a failure and closes its connection;
- ``{"cmd": "silence", "host": h}``: the ranks on host ``h`` fall silent (no beats, nothing read),
  their connections left open: a host whose network went down;
- ``{"cmd": "exit"}``: close everything and end.

Each rank numbers what it sends as a real rank's link does (``sparktrain.seam.session``), and says
goodbye before it closes. A rank told to stop (abort) records when (``time.monotonic``, one clock for every process of the
host), says it is quiet and closes. When its ranks are done, or on ``exit``, the process writes one
JSON line to stdout: ``{"aborted": {rank: t}, "failed_at": t, "silenced_at": t}``.

    python tests/simranks.py CONFIG_JSON     # what SimJob runs
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from sparktrain.seam import channel, protocol, session  # noqa: E402
from sparktrain.errors import RankFailure  # noqa: E402

#: What a late rank answers when the driver asks for its stacks.
STACK = 'Thread 0x01 (most recent call first):\n  File "train.py", line 7 in train_fn\n'


class _Rank:
    def __init__(self, rank: int, host: str, local_rank: int):
        self.rank, self.host, self.local_rank = rank, host, local_rank
        self.chan: channel.Channel | None = None
        self.running = False  # the peers came
        self.silent = False
        self.at: dict | None = None
        self.session = session.Session()

    def send(self, msg, numbered: bool = True) -> None:
        self.chan.send_encoded(self.session.wrap(protocol.encode(msg), numbered))

    def recv(self):
        body = self.chan.recv_body()
        if body is None:
            return None
        seq, ack, payload = session.split(body)
        msg = self.chan.decode(payload)
        return msg if self.session.take(seq, ack) else protocol.Beat()


class _Ranks:
    """One process's ranks, on one selector."""

    def __init__(self, config: dict):
        self.config = config
        self.ranks = [_Rank(r, h, lr) for r, h, lr in config["ranks"]]
        self.sel = selectors.DefaultSelector()
        self.report: dict = {"aborted": {}, "failed_at": None, "silenced_at": None}
        self.open = 0

    def connect(self) -> None:
        secret = bytes.fromhex(self.config["secret"])
        address = tuple(self.config["address"])
        for r in self.ranks:
            r.chan = channel.connect(address, secret, timeout=60.0, encrypted=self.config["encrypted"])
            r.send(protocol.CheckedIn(r.rank, r.host, 40000 + r.rank, 39999 if r.rank == 0 else 0,
                                      os.getpid(), r.rank, session=os.urandom(8).hex()))
            self.sel.register(r.chan.sock, selectors.EVENT_READ, r)
            self.open += 1

    def close(self, r: _Rank) -> None:
        if r.chan is None:
            return
        if not r.silent:
            self.sel.unregister(r.chan.sock)
            try:
                r.send(protocol.Bye())
            except OSError:
                pass
        r.chan.close()
        r.chan = None
        self.open -= 1

    def send(self, r: _Rank, msg, numbered: bool = True) -> None:
        if r.chan is None:
            return
        try:
            r.send(msg, numbered)
        except OSError:
            self.close(r)

    def on_message(self, r: _Rank) -> None:
        try:
            msg = r.recv()
        except (OSError, ValueError):
            msg = None
        if msg is None:
            self.close(r)
        elif isinstance(msg, protocol.Peers):
            r.running = True
        elif isinstance(msg, protocol.AskStacks):
            self.send(r, protocol.Stacks(STACK))
        elif isinstance(msg, protocol.Abort):
            self.report["aborted"][r.rank] = time.monotonic()
            self.send(r, protocol.Quiet())
            self.close(r)

    def command(self, cmd: dict) -> bool:
        """Carry out one command; False on exit."""
        what = cmd["cmd"]
        if what == "exit":
            return False
        if what == "print":
            for r in self.ranks:  # a rank prints once the peers came, as a real one does
                while r.chan is not None and not r.running and not r.silent:
                    self.on_message(r)
            for i in range(cmd["lines"]):
                for r in self.ranks:
                    if r.running and not r.silent:
                        self.send(r, protocol.Output("stdout", f"step {i}: loss 0.{r.rank:04d}", time.time()))
        elif what == "stall":
            collective = {"what": "allreduce", "dtype": "float32", "shape": [1024], "op": "sum"}
            for r in self.ranks:
                late = r.rank in cmd["late"]
                r.at = {**collective, "n": cmd["n"] - 1 if late else cmd["n"], "active": not late,
                        "age": 0.0 if late else 3600.0}
        elif what == "fail":
            for r in self.ranks:
                if r.rank == cmd["rank"] and r.chan is not None:
                    self.report["failed_at"] = time.monotonic()
                    self.send(r, protocol.RankFailed(RankFailure(
                        rank=r.rank, host=r.host, local_rank=r.local_rank, exc_type="ValueError",
                        message=f"simulated failure of rank {r.rank}", time=time.time())))
                    self.close(r)
        elif what == "silence":
            for r in self.ranks:
                if r.host == cmd["host"] and r.chan is not None:
                    self.report["silenced_at"] = time.monotonic()
                    self.sel.unregister(r.chan.sock)
                    r.silent = True
        return True

    def beat(self) -> None:
        for r in self.ranks:
            if r.running and not r.silent and r.chan is not None:
                self.send(r, protocol.Beat(r.at), numbered=False)

    def serve(self, control) -> None:
        self.sel.register(control, selectors.EVENT_READ, None)
        pending = b""
        beat_at = time.monotonic()
        try:
            while self.open:
                now = time.monotonic()
                if now - beat_at >= channel.BEAT_SECONDS:
                    beat_at = now
                    self.beat()
                for key, _ in self.sel.select(timeout=max(0.0, beat_at + channel.BEAT_SECONDS - now)):
                    if key.data is not None:
                        if key.data.chan is not None:
                            self.on_message(key.data)
                        continue
                    chunk = os.read(control, 65536)
                    if not chunk:
                        return
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        if not self.command(json.loads(line)):
                            return
        finally:
            for r in self.ranks:
                if r.chan is not None:
                    r.chan.close()


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    ranks = _Ranks(config)
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        return 1
    ranks.connect()
    ranks.serve(sys.stdin.fileno())
    sys.stdout.write(json.dumps(ranks.report) + "\n")
    sys.stdout.flush()
    return 0


# -- the driver's side: the job an attempt waits on ------------------------------------------------

def hosts_of(size: int, per_host: int) -> list[str]:
    """Each rank's host, ranks numbered by host: ``per_host`` ranks on each of ``host-0``, ``host-1``, ..."""
    return [f"host-{r // per_host}" for r in range(size)]


class SimJob:
    """The job of an attempt whose ranks are simulated: ``processes`` processes sharing the ranks.

    It follows ``sparktrain.driver.launch.jobs.Job``: it starts the processes (each says it is ready), then
    lets them all connect at once (:meth:`go`); it is done when every process has ended; cancelling
    it tells them to exit. What the processes report is in :attr:`reports`.
    """

    def __init__(self, spec, on_done, processes: int = 4, per_host: int = 8, go: bool = True):
        self.spec = spec
        self.error: BaseException | None = None
        self._on_done = on_done
        self._auto_go = go
        hosts = hosts_of(spec.size, per_host)
        self.hosts = hosts
        share = [list(range(spec.size))[i::processes] for i in range(min(processes, spec.size))]
        self.configs = [{"address": list(spec.driver_address), "secret": spec.secret.hex(),
                         "encrypted": spec.encrypted,
                         "ranks": [(r, hosts[r], r % per_host) for r in ranks]} for ranks in share]
        self.procs: list[subprocess.Popen] = []
        self.reports: list[dict] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._ready = threading.Event()

    def start(self) -> None:
        for config in self.configs:
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in self.procs:
            if json.loads(p.stdout.readline() or "{}").get("ready") is not True:
                raise RuntimeError("a simulated ranks' process did not start")
        self._ready.set()
        threading.Thread(target=self._wait, name="simranks-wait", daemon=True).start()
        if self._auto_go:
            self.go()

    def go(self) -> float:
        """Let every process connect its ranks; returns when (monotonic)."""
        self._ready.wait(60)
        now = time.monotonic()
        self.tell("go")
        return now

    def tell(self, cmd) -> None:
        line = cmd if isinstance(cmd, str) else json.dumps(cmd)
        with self._lock:
            for p in self.procs:
                try:
                    p.stdin.write(line + "\n")
                    p.stdin.flush()
                except (OSError, ValueError):
                    pass

    def _wait(self) -> None:
        for p in self.procs:
            out = p.stdout.readline()
            if out:
                self.reports.append(json.loads(out))
            p.wait()
        if any(p.returncode for p in self.procs):
            self.error = RuntimeError(f"simulated ranks' processes exited with {[p.returncode for p in self.procs]}")
        elif any(r["aborted"] or r["failed_at"] for r in self.reports):
            self.error = RuntimeError("simulated ranks were stopped")
        self._done.set()
        self._on_done()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def cancel(self) -> None:
        self.tell({"cmd": "exit"})

    def result_bytes(self) -> bytes | None:
        return None

    def kill(self) -> None:
        """End the processes (each is a child of this one, known by its Popen) and wait for them."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except (OSError, ValueError):
                    pass

    def aborted(self) -> dict[int, float]:
        """When each rank was told to stop (monotonic), from every process's report."""
        return {int(r): t for rep in self.reports for r, t in rep["aborted"].items()}

    def reported(self, key: str) -> float | None:
        return next((rep[key] for rep in self.reports if rep.get(key) is not None), None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
