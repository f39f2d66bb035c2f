"""The barrier task: what one Spark task does for its rank.

rendezvous -> build the env -> spawn the supervised child -> stream its output -> hand back the result.

:func:`barrier_task` is what Spark runs (the driver's jobs module ships it, with the spec, as
the ``mapInArrow`` function). The same :func:`run_rank` serves Spark tasks and local mode (where
the driver calls it from one thread per rank), so both share one env contract, supervision and
result path.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import json
import os
import re
import secrets
import selectors
import shutil
import socket
import sys
import tempfile
import time
from typing import Callable, Iterator, Mapping, Sequence

from .. import channel, settings, tracking, versions, worker_env
from ..errors import (InvalidArgumentError, RankError, RankFailure, ResultTooLargeError, SparkTrainError,
                      VersionMismatchError, type_name)
from ..data import layout
from ..localfiles import file_chunks
from ..spec import OUTPUT_SEQ, RESULT_FIELDS, SPILLED, TaskSpec
from . import warm as warm_process
from .child import EXIT_NOT_LET_GO
from .janitor import Janitor
from .spool import Spool, local_dir
from .supervisor import ChildProcess

#: Lines of output each rank keeps for its failure report.
TAIL_LINES = 100
#: Longest output line forwarded; longer lines are split.
MAX_LINE = 16 * 1024
#: Size of the pieces rank 0's pickled result travels in: well inside the 4 MiB Arrow batches
#: a Spark Connect server sends (``spark.connect.grpc.arrow.maxBatchSize``).
RESULT_CHUNK = 1024 * 1024

#: A C++ log line in absl's format, severity letter first (``I0000 00:00:17.5 123 port.cc:153] ...``).
_CPP_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ")
_CPP_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
#: What each of TensorFlow's two copies of absl prints once before its first line.
_ABSL_PREINIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
#: What TensorFlow logs as an error at start-up when it finds no GPU: expected in a rank told to use none.
_NO_GPU_LINE = re.compile(r"^E\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ cuda_\w+\.cc:\d+\] failed call to cuInit: ")


def below_log_level(line: str, level: int) -> bool:
    """Whether ``TF_CPP_MIN_LOG_LEVEL=level`` should have hidden this C++ log line.

    TensorFlow 2.21 prints its start-up lines (oneDNN, the CUDA stubs) through absl before it
    reads the variable, twice: once per copy of absl in its shared libraries. The rank's output
    pump drops them as the variable asks.

    >>> below_log_level("I0000 00:00:1795356405.409084    3599 port.cc:153] oneDNN custom operations are on.", 2)
    True
    >>> below_log_level("E0000 00:00:1795356405.409084    3599 rpc.cc:1] peer gone", 2)
    False
    """
    if line == _ABSL_PREINIT:
        return level >= 1
    m = _CPP_LOG_LINE.match(line)
    return m is not None and _CPP_SEVERITY[m.group(1)] < level

def reserve_port(attempts: int = 8) -> socket.socket:
    """Bind a free TCP port and hold it, so nobody else takes it before the child needs it.

    The caller closes the socket right before starting the child ("late handover"); the
    child's collective runtime then binds the same port.
    """
    last: OSError | None = None
    for _ in range(attempts):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("", 0))
            return s
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRINUSE:
                raise
            last = e
    raise OSError(errno.EADDRINUSE, f"no free port after {attempts} attempts: {last}")


def _pinned_cores(spec, topo: Mapping[str, int]) -> list[int] | None:
    """The cores this rank keeps to, or None. By default ("auto") only where the ranks own the
    machine: local mode and local masters, whose task CPUs are not counted (``spec.task_cpus`` None)."""
    mode = settings.resolve("pin_cores", environ={**os.environ, **spec.user_env})
    if mode == "off" or (mode == "auto" and spec.task_cpus is not None) or not hasattr(os, "sched_getaffinity"):
        return None
    return worker_env.rank_cores(sorted(os.sched_getaffinity(0)), topo["local_rank"], topo["local_size"])


def _child_pythonpath() -> str:
    """The child must import what this worker imports: sparktrain, and files shipped with
    sc.addPyFile, which live on this worker's sys.path but not in PYTHONPATH.

    Jars are left out: Spark puts its core jar on the Python workers' path, but since Spark 2 it
    holds no Python (pyspark.zip does), and addPyFile takes .py, .zip and .egg files only. Every
    rank process would read the jar's directory of some 6000 entries at start-up, about 20 ms of
    CPU each, before its first import.
    """
    parts = [p for p in sys.path if p and not p.endswith(".jar") and os.path.exists(p)]
    parts += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not p.endswith(".jar")]
    return os.pathsep.join(dict.fromkeys(parts))


class _Rank:
    """The state of one rank while it runs."""

    def __init__(self, spec: TaskSpec, rank: int, host: str):
        self.spec = spec
        self.rank = rank
        self.host = host
        self.local_rank = 0
        #: The barrier task's partition (-1 in local mode); the driver maps Spark's failed task to this rank.
        self.partition = -1
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.chan: channel.Channel | None = None
        self.abort_reason: str | None = None
        self.show = spec.output_ranks is None or rank in spec.output_ranks
        #: The rank's TF_CPP_MIN_LOG_LEVEL: C++ log lines below it are dropped (see below_log_level).
        self.log_level = 0
        #: Where the output also goes when the run has a log_url (see sparktrain.storage.outputlog).
        self.log = None
        #: The key the ranks' collective connections prove they hold (see collective_key).
        self.collective_key = b""

    def open_log(self) -> None:
        if self.spec.log_target is None or not self.show:
            return
        import cloudpickle

        from ..storage.outputlog import RankLog

        url, options = cloudpickle.loads(self.spec.log_target)
        try:
            self.log = RankLog(url, options, self.spec.run_id, self.rank)
        except Exception as e:  # noqa: BLE001 - the output's copy must never stop training
            print(f"sparktrain rank {self.rank}: cannot write output under {url}: {e}", file=sys.stderr)

    def flush_log(self, force: bool = False) -> None:
        if self.log is None:
            return
        try:
            self.log.flush(force)
        except Exception as e:  # noqa: BLE001 - the output's copy must never stop training
            print(f"sparktrain rank {self.rank}: stopped writing output to storage: {e}", file=sys.stderr)
            self.log = None

    # -- channel -----------------------------------------------------------------------------
    def send(self, msg: dict) -> bool:
        """Send to the driver; False if there is no channel. If streaming fails, training does not:
        the channel is dropped."""
        if self.chan is None:
            return False
        try:
            self.chan.send(msg)
            return True
        except (OSError, ValueError) as e:
            print(f"sparktrain rank {self.rank}: lost the driver channel ({e}); output now goes to this "
                  f"executor's log", file=sys.stderr)
            self.chan.close()
            self.chan = None
            return False

    def failure(self, **kw) -> RankFailure:
        kw.setdefault("time", time.time())  # the child records when its exception happened
        return RankFailure(rank=self.rank, host=self.host, local_rank=self.local_rank,
                           output_tail=tuple(self.tail), **kw)

    # -- rendezvous --------------------------------------------------------------------------
    def check_versions(self) -> None:
        """Fail this rank at once, with a readable diff, when its versions differ from the driver's."""
        if self.spec.versions is None:
            return
        diff = versions.mismatches(self.spec.versions, versions.collect())
        if diff:
            raise VersionMismatchError(
                f"rank {self.rank} on {self.host} runs other versions than the driver:\n  " + "\n  ".join(diff)
                + "\nInstall the same versions on the executors as on the driver (for example with the same "
                "requirements file or cluster library list)")

    def rendezvous(self, port: int, master_port: int, barrier_ctx, shard: dict[str, int],
                   checked_in: Callable[[], None] = lambda: None,
                   ) -> tuple[list[str], list[int], int, list[dict[str, int]]]:
        """Meet the other ranks: every rank's host and ports, and its row count per fed DataFrame.

        ``checked_in`` is called once this rank has said hello and its versions match, before it
        waits for the others (the task starts the rank's process there, held)."""
        me = {"type": "hello", "rank": self.rank, "partition": self.partition, "host": self.host, "port": port,
              "master_port": master_port, "pid": os.getpid(), "shard": shard}
        spec = self.spec
        if spec.driver_address is None:
            # One Spark barrier sync (about a second): the path for executors that cannot reach
            # the driver, such as under Spark Connect. With no driver secret, rank 0 makes the
            # collective key and shares it through the sync.
            self.check_versions()
            checked_in()
            if self.rank == 0:
                me["collective_key"] = secrets.token_hex(32)
            infos = [json.loads(m) for m in barrier_ctx.allGather(json.dumps(me))]
            infos.sort(key=lambda i: i["rank"])
            self.collective_key = bytes.fromhex(infos[0]["collective_key"])
            return ([i["host"] for i in infos], [int(i["port"]) for i in infos], int(infos[0]["master_port"]),
                    [i["shard"] for i in infos])
        self.collective_key = collective_key(spec.secret, spec.run_id, spec.attempt)
        try:
            self.chan = channel.connect(spec.driver_address, spec.secret, timeout=min(30.0, spec.start_timeout))
        except OSError as e:
            raise SparkTrainError(
                f"rank {self.rank} on {self.host} cannot reach the driver's channel at "
                f"{spec.driver_address[0]}:{spec.driver_address[1]}: {e}. If executors cannot open "
                "connections to the driver, set spark.sparktrain.rendezvous=barrier"
            ) from None
        self.chan.send(me)
        self.check_versions()  # after the hello, so the failure report reaches the driver at once
        checked_in()
        self.chan.sock.settimeout(spec.start_timeout)
        try:
            msg = self.chan.recv()
        except socket.timeout:
            raise SparkTrainError(
                f"rank {self.rank} waited {spec.start_timeout:.0f} s for the other ranks to start "
                "(start_timeout); see the driver's error for which ranks never started"
            ) from None
        # A driver that stops reading must not block this rank's output (and so its training)
        # for ever: a send that cannot finish in 30 s drops the channel instead.
        self.chan.sock.settimeout(30.0)
        if msg is None:
            raise SparkTrainError(f"rank {self.rank}: the driver closed the channel during rendezvous")
        if msg["type"] == "abort":
            self.abort_reason = msg.get("reason", "stopped by the driver")
            raise SparkTrainError(f"rank {self.rank} was stopped before it started: {self.abort_reason}")
        return (msg["hosts"], [int(p) for p in msg["ports"]], int(msg["master_port"]),
                msg.get("shards") or [{}] * len(msg["hosts"]))

    # -- output ------------------------------------------------------------------------------
    def emit(self, stream: str, line: str) -> None:
        if stream == "stderr" and self.log_level and (
                below_log_level(line, self.log_level) or (not self.spec.use_gpu and _NO_GPU_LINE.match(line))):
            return
        self.tail.append(line if stream == "stdout" else f"[stderr] {line}")
        if not self.show:
            return
        if self.log is not None:
            self.log.add(stream, line, time.time())
        if self.chan is not None:
            self.send({"type": "out", "stream": stream, "line": line, "time": time.time()})
        if self.chan is None:
            print(f"[{self.rank}]<{stream}>:{line}", file=sys.stderr if stream == "stderr" else sys.stdout)

    def pump(self, child: ChildProcess) -> None:
        """Forward the child's output until it exits or the driver says stop."""
        sel = selectors.DefaultSelector()
        buffers = {}
        for stream, f in (("stdout", child.stdout), ("stderr", child.stderr)):
            os.set_blocking(f.fileno(), False)
            sel.register(f.fileno(), selectors.EVENT_READ, stream)
            buffers[stream] = b""
        driver_sock = self.chan.sock if self.chan is not None else None
        if driver_sock is not None:
            sel.register(driver_sock, selectors.EVENT_READ, "driver")
        open_pipes = 2
        exited_at = None
        try:
            while open_pipes:
                if driver_sock is not None and self.chan is None:  # the channel broke in send()
                    sel.unregister(driver_sock)
                    driver_sock = None
                for key, _ in sel.select(timeout=0.5):
                    if key.data == "driver" and self.chan is None:
                        continue
                    if key.data == "driver":
                        self._on_driver_message(child)
                        continue
                    try:
                        chunk = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_pipes -= 1
                        if buffers[key.data]:
                            self.emit(key.data, buffers[key.data].decode(errors="replace"))
                        continue
                    buffers[key.data] = self._lines(key.data, buffers[key.data] + chunk)
                self.flush_log()
                if child.poll() is not None:
                    # A grandchild may hold the pipes open after the child exited: give the
                    # last lines a moment to arrive, then stop waiting for EOF.
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 1.0:
                        break
        finally:
            sel.close()
            self.flush_log(force=True)

    def _lines(self, stream: str, data: bytes) -> bytes:
        *lines, rest = data.split(b"\n")
        for raw in lines:
            self.emit(stream, raw.rstrip(b"\r").decode(errors="replace"))
        while len(rest) > MAX_LINE:
            self.emit(stream, rest[:MAX_LINE].decode(errors="replace"))
            rest = rest[MAX_LINE:]
        return rest

    def _on_driver_message(self, child: ChildProcess) -> None:
        try:
            msg = self.chan.recv()
        except (OSError, channel.AuthenticationError):
            msg = None
        if msg is None:
            self.chan.close()
            self.chan = None  # pump() unregisters the socket
            return
        if msg.get("type") == "abort" and self.abort_reason is None:
            self.abort_reason = msg.get("reason", "stopped by the driver")
            child.stop(self.spec.grace_period)


def collective_key(secret: bytes, run_id: str, attempt: int) -> bytes:
    """The key of the ranks' collective connections, derived from the attempt's channel secret.

    The rank's process gets this derived key, never the channel's secret itself.
    """
    return hmac.new(secret, f"sparktrain-collective|{run_id}|{attempt}".encode(), hashlib.sha256).digest()


def _write_key(workdir: str, key: bytes) -> str:
    path = os.path.join(workdir, "collective.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return path


def _gpu_ids(spec: TaskSpec, rank: int, gpu_addresses: Sequence[str] | None) -> str:
    if not spec.use_gpu:
        return worker_env.NO_GPU
    if not gpu_addresses:
        raise SparkTrainError(
            f"use_gpu=True but Spark assigned no GPU to rank {rank}'s task; set "
            "spark.task.resource.gpu.amount=1 and spark.executor.resource.gpu.amount on the cluster"
        )
    return worker_env.translate_gpu_ids(list(gpu_addresses), os.environ.get("CUDA_VISIBLE_DEVICES"))


#: What a held rank process (see ``ChildProcess.go``) still takes when it is let go: what the rendezvous
#: decides, which only sparktrain, TensorFlow and OpenMP read, after the go. Never a variable the
#: interpreter reads as it starts (PYTHONPATH, PYTHONHASHSEED, LD_PRELOAD, ...).
_LATE_VARS = worker_env.RESERVED_VARS | frozenset(worker_env.THREAD_VARS) | {worker_env.CORES, "TF_CPP_MIN_LOG_LEVEL"}


def _late(name: str) -> bool:
    # sparktrain's own settings, and MLflow's, are read in the rank after its go, like the topology.
    return name in _LATE_VARS or name.startswith(("SPARKTRAIN_", "MLFLOW_"))


def _early_env(spec: TaskSpec, rank: int, workdir: str) -> dict[str, str]:
    """The rank process's environment as far as it is known before the rendezvous: the executor's,
    the user's ``env``, MLflow's hand-off, the import path and TensorFlow's log level. The rest
    (topology, ports, threads, cores, keys, GPUs) is in ``_LATE_VARS``."""
    env = dict(os.environ)
    env.update(worker_env.build_worker_env(rank=0, hosts=[""], ports=[0], master_port=0, gpu_ids="",
                                           run_id=spec.run_id, user_env=spec.user_env))
    for name in _LATE_VARS:
        env.pop(name, None)
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(tracking.rank_env(rank, spec.mlflow, workdir))
    env["PYTHONPATH"] = _child_pythonpath()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", str(spec.tf_log_level))
    return env


def _env_changes(early: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str | None] | None:
    """What turns ``early`` into ``env`` (None: remove the variable), or None when a variable outside
    ``_LATE_VARS`` differs, which a process already started cannot take.

    >>> _env_changes({"A": "1", "SPARKTRAIN_RANK": "0"}, {"A": "1", "SPARKTRAIN_RANK": "2", "OMP_NUM_THREADS": "1"})
    {'SPARKTRAIN_RANK': '2', 'OMP_NUM_THREADS': '1'}
    >>> _env_changes({"PYTHONPATH": "/a"}, {"PYTHONPATH": "/b"}) is None
    True
    """
    changes: dict[str, str | None] = {k: v for k, v in env.items() if early.get(k) != v}
    changes.update({k: None for k in early if k not in env})
    return None if not all(map(_late, changes)) else changes


def run_rank(spec: TaskSpec, rank: int, host: str, gpu_addresses: Sequence[str] | None = None,
             barrier_ctx=None, batches=None, output: list[str] | None = None, warm: bool = False,
             partition: int = -1) -> Iterator[bytes]:
    """Run ``rank`` to completion. Yields rank 0's pickled result in chunks; raises RankError on failure.

    ``warm``: this process runs one task at a time and is reused (a Spark Python worker): the rank
    takes the warm process the last run left, if any, and a run that succeeded leaves one (see
    ``executor.warm``).

    ``batches`` is this task's share of the fed DataFrames (``spec.feed``), spooled before the
    rendezvous; ``data_dir`` holds the spool, and a janitor process removes it however the task ends.
    ``output``, when given, receives the rank's output tail once it succeeded.
    """
    state = _Rank(spec, rank, host)
    state.partition = partition
    workdir = tempfile.mkdtemp(prefix=f"sparktrain-{spec.run_id}-r{rank}-")
    child = warm_process.take() if warm and spec.warm_process else None
    if child is not None and _env_changes(child.env, _early_env(spec, rank, workdir)) is None:
        # Something it has read already differs for this run (the user's env, say): release it now,
        # before it is moved here, for its watcher removes the directories it was moved to.
        child.release(spec.grace_period)
        child = None
    warm_home = None  # the warm process's own directory, removed with this run's
    if child is not None:
        warm_home = child.workdir
        child.move(workdir)  # its watcher now also cleans up this run's directory
    succeeded = False
    janitor = data_dir = spool = None
    try:
        try:
            # The rank's process is the warm one the last run left, or starts once this rank has
            # checked in (its hello is not delayed), held, so its interpreter comes up while the
            # ranks meet; it is let go with the rest of its environment once they have.
            early_env = child.env if child is not None else _early_env(spec, rank, workdir)

            def start_held() -> None:
                nonlocal child
                if child is None:
                    child = ChildProcess(workdir, early_env, held=True)

            if spec.feed:
                data_dir = tempfile.mkdtemp(prefix=f"sparktrain-{spec.run_id}-r{rank}-data-", dir=local_dir())
                janitor = Janitor(data_dir)
                spool = Spool(data_dir, spec.feed)
                spool.consume(batches if batches is not None else ())
            elif batches is not None:
                for _ in batches:  # the input is one row per task; only the partition id matters
                    pass
            reserved = [reserve_port()] + ([reserve_port()] if rank == 0 else [])
            port = reserved[0].getsockname()[1]
            master_port = reserved[1].getsockname()[1] if rank == 0 else 0
            try:
                hosts, ports, master_port, shards = state.rendezvous(
                    port, master_port, barrier_ctx, spool.rows if spool else {}, start_held)
            finally:
                for s in reserved:  # hand the ports over: the child binds them next
                    s.close()
            topo = worker_env.topology(hosts, rank)
            state.local_rank = topo["local_rank"]
            state.open_log()
            # The task's CPUs (its resource profile's, or spark.task.cpus on a cluster); on a local
            # master or in local mode, this host's cores shared among its ranks.
            threads = worker_env.rank_threads(spec.task_cpus, os.cpu_count(), topo["local_size"])
            env = dict(os.environ)
            env.update(worker_env.build_worker_env(
                rank=rank, hosts=hosts, ports=ports, master_port=master_port,
                gpu_ids=_gpu_ids(spec, rank, gpu_addresses), run_id=spec.run_id, user_env=spec.user_env,
                attempt=spec.attempt, max_attempts=spec.max_attempts, threads=threads,
            ))
            env.update(worker_env.thread_defaults(threads, spec.user_env))
            cores = _pinned_cores(spec, topo)
            if cores:
                env[worker_env.CORES] = ",".join(map(str, cores))
            env.update(tracking.rank_env(rank, spec.mlflow, workdir))
            env["PYTHONPATH"] = _child_pythonpath()
            env[worker_env.COLLECTIVE_KEY_FILE] = _write_key(workdir, state.collective_key)
            if spool is not None:
                empty = [n for n in spec.feed if not sum(int(s.get(n, 0)) for s in shards)]
                if empty:  # every rank sees the same counts, so every rank stops here alike
                    raise InvalidArgumentError(layout.no_rows(empty[0]))
                state.emit("stderr", spool.describe(rank))
                layout.write_manifest(data_dir, rank, {n: [int(s.get(n, 0)) for s in shards] for n in spec.feed})
                env[worker_env.DATA_DIR] = data_dir
            # The user's env or the executor's own wins; otherwise the run's default (quiet unless verbose=2).
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", str(spec.tf_log_level))
            try:
                state.log_level = int(env["TF_CPP_MIN_LOG_LEVEL"])
            except ValueError:
                state.log_level = 0
            with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
                f.write(spec.payload)
            if spec.checkpoint is not None and rank == 0:
                with open(os.path.join(workdir, "checkpoint.pkl"), "wb") as f:
                    f.write(spec.checkpoint)
            changes = _env_changes(early_env, env)
            # Something only a new interpreter reads changed, or the held process could not take its
            # go (it died while the ranks met): start the rank's process afresh.
            if changes is None or not child.go(changes, workdir):
                child.release(spec.grace_period)
                child = ChildProcess(workdir, env)
        except SparkTrainError as e:
            raise _failed(state, state.failure(exc_type=type_name(e), message=str(e),
                                               retryable=e.retryable)) from None
        except Exception as e:
            import traceback
            raise _failed(state, state.failure(exc_type=type_name(e), message=str(e),
                                               traceback=traceback.format_exc())) from None

        state.pump(child)
        # Stopped by the driver: already terminated. Otherwise let it exit, then end any
        # descendants it left behind in its group.
        code = child.stop(spec.grace_period) if state.abort_reason else child.reap(spec.grace_period)
        child.close_pipes()

        if state.abort_reason is not None:
            # Not a root cause: the driver stopped this rank because of another one.
            raise SparkTrainError(f"sparktrain rank {rank} was stopped: {state.abort_reason}")
        error_path = os.path.join(workdir, "error.json")
        if code != 0 or os.path.exists(error_path):
            info = {}
            if os.path.exists(error_path):
                with open(error_path) as f:
                    info = json.load(f)
            elif code == EXIT_NOT_LET_GO:
                info = {"exc_type": "SparkTrainError",
                        "message": f"rank {rank}'s process was started held and never let go: it ran nothing"}
            raise _failed(state, state.failure(exitcode=code, **info))
        if rank == 0:
            result_path = os.path.join(workdir, "result.pkl")
            if not os.path.exists(result_path):
                raise _failed(state, state.failure(exitcode=code, exc_type="SparkTrainError", message=(
                    f"rank 0's process exited with code 0 but left no result in {workdir} "
                    f"({'which holds ' + ', '.join(sorted(os.listdir(workdir))) if os.path.isdir(workdir) else 'which is gone'})")))
            yield from _result_chunks(state, result_path)
        if output is not None:
            output.extend(state.tail)
        succeeded = True
    finally:
        if child is not None and child.poll() is None:
            child.stop(spec.grace_period)  # the task itself is being torn down
        if child is not None:
            child.close_pipes()
        if state.chan is not None:
            state.chan.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if warm_home is not None:
            shutil.rmtree(warm_home, ignore_errors=True)
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
        if janitor is not None:
            janitor.finish()
        if succeeded and warm and spec.warm_process:
            warm_process.leave(lambda home: _early_env(spec, rank, home))


def _failed(state: _Rank, failure: RankFailure) -> RankError:
    delivered = state.send({"type": "failed", "failure": failure.to_dict()})
    # The report travels inside Spark's exception text only when the channel could not carry
    # it: otherwise Spark's own log lines would repeat it, traceback and all, for every rank.
    return RankError(failure, carry_report=not delivered)


def _result_chunks(state: _Rank, path: str) -> Iterator[bytes]:
    size = os.path.getsize(path)
    limit = state.spec.max_result_bytes
    # Spark counts serialized task results against spark.driver.maxResultSize; leave it headroom.
    if limit and size + (1 << 20) > limit:
        if state.spec.spill_url:
            from .. import storage

            url = f"{state.spec.spill_url.rstrip('/')}/sparktrain-{state.spec.run_id}/result.pkl"
            try:
                storage.put_file(path, url)
            except Exception as e:  # noqa: BLE001
                raise _failed(state, state.failure(exc_type=type_name(e), message=(
                    f"rank 0's return value ({size / 2**20:.1f} MiB pickled) is too large for "
                    f"spark.driver.maxResultSize and could not be spilled to {url}: {e}"))) from None
            yield SPILLED + url.encode()
            return
        err = ResultTooLargeError(
            f"rank 0's return value is {size / 2**20:.1f} MiB pickled, more than spark.driver.maxResultSize "
            f"({limit / 2**20:.0f} MiB) allows. Pass checkpoint_url= to send it straight to storage, set "
            "spark.sparktrain.spillUrl to a storage prefix the driver can read, or raise "
            f"spark.driver.maxResultSize (for example to {max(2 * size, 1 << 30) // 2**20}m)"
        )
        raise _failed(state, state.failure(exc_type=type_name(err), message=str(err), retryable=err.retryable))
    yield from file_chunks(path, RESULT_CHUNK)


def barrier_task(spec: TaskSpec):
    """The function each barrier task runs (``mapInArrow``'s); it is pickled with ``spec`` inside."""

    def run_barrier_task(batches):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        partition = ctx.partitionId()
        # Ranks are numbered by host, as Horovod numbers them; every task computes the same list.
        task_hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
        rank = worker_env.ranks_by_host(task_hosts)[partition]
        if ctx.attemptNumber() > 0:
            raise RuntimeError(f"sparktrain rank {rank}: Spark retried this task; a rank is never re-run alone, "
                               "so this attempt stops")
        host = task_hosts[partition]
        gpu = ctx.resources().get("gpu")
        output: list[str] | None = [] if spec.return_output else None
        rows = enumerate(run_rank(spec, rank, host, gpu.addresses if gpu else [], ctx, batches, output, warm=True,
                                  partition=partition))
        for seq, chunk in rows:
            yield _row(rank, seq, chunk)
        if output:
            yield _row(rank, OUTPUT_SEQ, "\n".join(output).encode())

    def _row(rank: int, seq: int, data: bytes):
        import pyarrow as pa

        return pa.RecordBatch.from_arrays(
            [pa.array([rank], pa.int32()), pa.array([seq], pa.int32()), pa.array([data], pa.binary())],
            names=list(RESULT_FIELDS))

    return run_barrier_task
