"""The barrier task: what one Spark task does for its rank.

It runs these steps in order (see :func:`run_rank`):

1. **watch**: remove what ranks of dead tasks left on this host, make the rank's work directory
   (workdirs.py), and start the rank's watcher (watcher.py), which removes what the rank owns if
   this task dies;
2. **spool**: write this task's share of the fed DataFrames to local disk;
3. **rendezvous**: meet the other ranks (rendezvous.py); the rank's process starts, held, as
   soon as this rank has checked in, so its interpreter comes up while the ranks meet;
4. **env**: build the rank's whole environment once (rankenv.py) and let the process go with it;
5. **output**: forward its output until it exits (output.py);
6. **result**: read how it ended, and hand rank 0's result back in chunks (result.py).

:func:`barrier_task` is what Spark runs (the driver's jobs module ships it, with the spec, as
the ``mapInArrow`` function). The same :func:`run_rank` serves Spark tasks and local mode (where
the driver calls it from one thread per rank), so both share one env contract, supervision and
result path.
"""
from __future__ import annotations

import os
from typing import Iterator, Sequence

from ..host import nics, tflog
from ..seam import topology, worker_env
from ..data import layout
from ..errors import InvalidArgumentError, SparkTrainError
from ..storage import rank as rank_storage
from ..seam.spec import OUTPUT_SEQ, RESULT_FIELDS, TaskSpec
from . import rankenv, workdirs
from .output import RankIO
from .rendezvous import rendezvous, reserve_port
from .result import outcome, result_chunks, start_failure
from .spool import Spool, local_dir
from .supervisor import ChildProcess
from .watcher import Watcher
from .workdirs import OwnedDir, sweep


def run_rank(spec: TaskSpec, rank: int, host: str, gpu_addresses: Sequence[str] | None = None,
             barrier_ctx=None, batches=None, output: list[str] | None = None, partition: int = -1,
             ) -> Iterator[bytes]:
    """Run ``rank`` to completion. Yields rank 0's pickled result in chunks; raises RankError on failure.

    ``batches`` is this task's share of the fed DataFrames (``spec.feed``), spooled before the
    rendezvous; without a feed it is not read here (see :func:`barrier_task`). ``output``, when
    given, receives the rank's output tail once it succeeded. ``partition`` is the barrier task's
    partition (-1 in local mode), which the driver uses to name the rank of a task that Spark
    reports failed.
    """
    state = RankIO(spec, rank, host)
    state.partition = partition
    sweep([None, local_dir()])  # what ranks of this host left when the whole host died
    owned = [OwnedDir(f"sparktrain-{spec.run_id}-r{rank}-")]
    workdir = owned[0].path
    watcher = Watcher(workdir)
    child: ChildProcess | None = None
    try:
        try:
            if spec.nics:  # the address this host offers the other ranks, on the network nics names
                state.host = nics.own_address(spec.nics, f"rank {rank}'s host {host}")
            data_dir = spool = None
            if spec.feed or spec.scans:  # the spool, and the cache of what the rank reads from files
                owned.append(OwnedDir(f"sparktrain-{spec.run_id}-r{rank}-data-", local_dir()))
                data_dir = owned[-1].path
                watcher.own(data_dir)
            if spec.feed:
                spool = Spool(data_dir, spec.feed)
                spool.consume(batches if batches is not None else ())

            def start_held() -> None:
                nonlocal child
                child = ChildProcess(workdir, rankenv.start_env(spec), held=True)
                watcher.watch_rank(child.pidfd)

            reserved = [reserve_port()] + ([reserve_port()] if rank == 0 else [])
            port = reserved[0].getsockname()[1]
            master_port = reserved[1].getsockname()[1] if rank == 0 else 0
            try:
                met = rendezvous(state, port, master_port, barrier_ctx, spool.rows if spool else {}, start_held)
            finally:
                for s in reserved:  # hand the ports over: the child binds them next
                    s.close()
            env = _prepare(state, met, gpu_addresses, workdir, data_dir, spool)
            if child is None or not child.go(env):
                # Not started (the barrier rendezvous failed first), or it died while the ranks met.
                if child is not None:
                    child.stop(spec.grace_period)
                    child.close()
                child = ChildProcess(workdir, env)
                watcher.watch_rank(child.pidfd)
        except Exception as e:
            raise start_failure(state, e) from None

        state.pump(child)
        # Stopped by the driver: already terminated. Otherwise let it exit, then end any
        # descendants it left behind in its group.
        code = child.stop(spec.grace_period) if state.abort_reason else child.reap(spec.grace_period)
        child.close_pipes()
        _raise_failure(state, code, workdir, child.killed_elsewhere)
        if rank == 0:
            yield from result_chunks(state, os.path.join(workdir, workdirs.VALUE))
        if output is not None:
            output.extend(state.tail)
    finally:
        if child is not None:
            child.stop(spec.grace_period)  # ends the group if the task itself is being torn down
            child.close()
        state.close_link()  # once the driver has everything the rank sent (it may reconnect first)
        for d in owned:  # first: a task killed while its watcher finishes must leave nothing behind
            d.close()
        watcher.finish()


def _prepare(state: RankIO, met, gpu_addresses: Sequence[str] | None, workdir: str, data_dir: str | None,
             spool: Spool | None) -> dict[str, str]:
    """Once the ranks met (``met``: every rank's host and port, rank 0's master port, every task's
    row counts): the rank's environment, its share of the data, its payload on disk."""
    spec, rank = state.spec, state.rank
    hosts, ports, master_port, shards = met
    topo = topology.topology(hosts, rank)
    state.local_rank = topo["local_rank"]
    state.open_log()
    env = rankenv.rank_env(spec, rank, hosts, ports, master_port, topo, gpu_addresses, workdir,
                           state.collective_key, data_dir)
    state.progress_path = env[worker_env.PROGRESS_FILE]
    if data_dir is not None:
        empty = [n for n in spec.feed if not sum(int(s.get(n, 0)) for s in shards)]
        if empty:  # every rank sees the same counts, so every rank stops here alike
            raise InvalidArgumentError(layout.no_rows(empty[0]))
        if spool is not None:
            state.emit("stderr", spool.describe(rank))
        rows = {n: [int(s.get(n, 0)) for s in shards] for n in spec.feed}
        layout.write_manifest(data_dir, rank, rows, layout.scan_shares(spec.scans, spec.size, rank, rows))
    state.startup = tflog.StartupFilter(tflog.level_from_env(env), no_gpu=not spec.use_gpu)
    with open(os.path.join(workdir, workdirs.PAYLOAD), "wb") as f:
        f.write(spec.payload)
    if spec.checkpoint is not None and rank == 0:
        with open(os.path.join(workdir, workdirs.CHECKPOINT_URL), "w") as f:
            f.write(spec.checkpoint)
    rank_storage.write(workdir, spec.storage_options)
    return env


def _raise_failure(state: RankIO, code: int, workdir: str, killed_elsewhere: bool = False) -> None:
    """Raise how the rank's process failed, or that the driver stopped it; nothing when it succeeded.

    A rank that failed on its own (it recorded a failure, its process had exited before the stop,
    or something other than its task killed it) reports that even when the stop came first: its
    peers can fail at once when its process leaves (JAX's gloo), and reach the driver before it
    does.
    """
    own = (state.abort_reason is None or state.exited_before_abort or killed_elsewhere
           or _failed_before(workdir, state.aborted_at))
    error = outcome(state, code, workdir) if own else None
    if error is not None:
        raise error
    if state.abort_reason is not None:
        # Not a root cause: the driver stopped this rank because of another one.
        raise SparkTrainError(f"sparktrain rank {state.rank} was stopped: {state.abort_reason}")


def _failed_before(workdir: str, when: float) -> bool:
    """Whether the rank's process recorded a failure of its own (``error.json``) before ``when``."""
    import json

    try:
        with open(os.path.join(workdir, workdirs.ERROR)) as f:
            return float(json.load(f).get("time", when)) < when
    except (OSError, ValueError):
        return False


def barrier_task(spec: TaskSpec):
    """The function each barrier task runs (``mapInArrow``'s); it is pickled with ``spec`` inside."""

    def run_barrier_task(batches):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        partition = ctx.partitionId()
        # Ranks are numbered by host, as Horovod numbers them; every task computes the same list.
        task_hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
        rank = topology.ranks_by_host(task_hosts)[partition]
        if ctx.attemptNumber() > 0:
            raise RuntimeError(f"sparktrain rank {rank}: Spark retried this task; a rank is never re-run alone, "
                               "so this attempt stops")
        host = task_hosts[partition]
        gpu = ctx.resources().get("gpu")
        output: list[str] | None = [] if spec.return_output else None
        rows = enumerate(run_rank(spec, rank, host, gpu.addresses if gpu else [], ctx, batches, output,
                                  partition=partition))
        for seq, chunk in rows:
            yield _row(rank, seq, chunk)
        # Without a feed the input is one row per task, of which only the partition id matters,
        # and PySpark's worker expects it read to its end: it is read now, once the rank is done,
        # so that each rank's hello does not wait for the JVM to send that row. With a feed,
        # run_rank has read it all.
        for _ in batches:
            pass
        if output:
            yield _row(rank, OUTPUT_SEQ, "\n".join(output).encode())

    def _row(rank: int, seq: int, data: bytes):
        import pyarrow as pa

        return pa.RecordBatch.from_arrays(
            [pa.array([rank], pa.int32()), pa.array([seq], pa.int32()), pa.array([data], pa.binary())],
            names=list(RESULT_FIELDS))

    return run_barrier_task
