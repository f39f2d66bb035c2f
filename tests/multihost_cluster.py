"""The multi-host tier's cluster: a Spark standalone cluster whose workers are simulated hosts
(tests/simhosts.py: a network namespace, hostname, /etc/hosts, /dev/shm and core each; and
tests/standalone.py), started once for the modules in a row that ask for the same shape (the
test_multihost*.py modules, run with ``-n 0``: 2 hosts of 2 slots, then test_multihost_wide.py's 8
hosts of 2). The driver is the test process, on the hosts' bridge. Also the helpers those modules
share: runs that allreduce across the hosts until a fault, and what a run left behind."""
from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest

import simhosts
from standalone import cluster_session

import sparktrain

WHY_NOT = simhosts.why_not()
#: Apply to every multi-host test module: the tier's mark, and a skip with the reason where
#: simulated hosts cannot be made (not root, no ``ip``).
MARKS = [pytest.mark.multihost, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

HOSTS, PER_HOST = 2, 2


#: The cluster up now: ``[((hosts, per_host), its context manager, (SimHosts, Standalone, session))]``.
#: One at a time (a process has one SparkContext): asking for another shape takes this one down.
_up: list = []


def _take_down() -> None:
    if _up:
        _up.pop()[1].__exit__(None, None, None)


def _cluster_of(hosts: int, per_host: int) -> tuple:
    if _up and _up[0][0] != (hosts, per_host):
        _take_down()
    if not _up:
        manager = cluster_session(hosts, per_host)
        _up.append(((hosts, per_host), manager, manager.__enter__()))
    return _up[0][2]


@pytest.fixture(scope="session")
def _clusters():
    """The last cluster goes at the end of the session; nothing is left of it after."""
    yield
    _take_down()


@pytest.fixture(scope="module")
def cluster(_clusters):
    """``(SimHosts, Standalone, session)`` of HOSTS hosts with PER_HOST slots each, started once
    for every module that asks for it in a row (the tier runs them one after another)."""
    return _cluster_of(HOSTS, PER_HOST)


@pytest.fixture(scope="module")
def cluster8(_clusters):
    """The same of 8 hosts with 2 slots each: 16 ranks (tests/test_multihost_wide.py)."""
    return _cluster_of(8, 2)


def allreduce_until_stopped(outdir):
    """Every rank allreduces across the hosts until it is stopped; it says once that it runs, and where."""
    import json
    import socket

    import numpy as np

    from helpers import mark_time
    from sparktrain import engine

    comm = engine.from_env()
    if comm.rank == 0:
        with open(os.path.join(outdir, "run_id"), "w") as f:
            json.dump(os.environ["SPARKTRAIN_RUN_ID"], f)
    comm.allreduce(np.ones(1000), "sum")
    with open(os.path.join(outdir, f"host-{comm.rank}"), "w") as f:
        f.write(socket.gethostname())
    mark_time(outdir, f"running-{comm.rank}")
    while True:
        comm.allreduce(np.ones(1000), "sum")


def when_running(outdir, n: int, fault) -> tuple:
    """A started thread that runs ``fault()`` once every rank of ``n`` has written its running
    file in ``outdir``, and the list that gets the time it began."""
    import threading

    from helpers import wait_for_file

    at: list[float] = []

    def wait_then_fault():
        for r in range(n):
            wait_for_file(os.path.join(str(outdir), f"running-{r}"), 120)
        at.append(time.monotonic())
        fault()

    thread = threading.Thread(target=wait_then_fault, daemon=True)
    thread.start()
    return thread, at


def fail_by(tmp_path, n: int, fault) -> tuple:
    """Run ``allreduce_until_stopped`` on ``n`` ranks with ``fault()`` once they all run; returns
    the run's RankFailedError, when the fault began and when the run failed."""
    thread, at = when_running(tmp_path, n, fault)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(allreduce_until_stopped, args=(str(tmp_path),), num_proc=n, timeout=90, verbose=0)
    failed_at = time.monotonic()
    thread.join(5)
    return e.value, at[0], failed_at


def ranks_on(outdir, hostname: str, n: int = HOSTS * PER_HOST) -> list[int]:
    return [r for r in range(n) if open(os.path.join(outdir, f"host-{r}")).read() == hostname]


def run_id_of(outdir) -> str:
    import json

    with open(os.path.join(outdir, "run_id")) as f:
        return json.load(f)


def work_dirs(run_id: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"sparktrain-{run_id}-r*")))
