"""Fault injection on a real local[4] Spark: every failure ends the run promptly, names the rank,
and leaves no process behind.

Each scenario records how long the failure took to surface (or the clean-up to finish) through
``helpers.fault_time``; ``benchmarks/fault_bounds.py`` runs this module three times and reports the
medians against each scenario's bound. The tests themselves assert outcomes, not times: their
hard timeouts are what keeps a hang from passing.
"""
from __future__ import annotations

import io
import os
import re
import signal
import tempfile
import threading
import time

import psutil
import pytest

import sparktrain
from conftest import module_spark
from helpers import (fault_time, mark_time, rank_processes, read_ranks, read_time, record_rank, wait_for_file,
                     wait_for_ranks, wait_pids_gone)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]

#: Quiet TensorFlow in the ranks.
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


spark = module_spark("local[4]")


def run_pids(outdir: str, size: int) -> list[int]:
    ranks = read_ranks(outdir)
    assert sorted(ranks) == list(range(size)), ranks
    return [r["pid"] for r in ranks.values()]


def leftovers(run_id: str, timeout: float = 5.0) -> list[str]:
    """Work directories of ``run_id`` left in the temp dir once its processes (ranks and their
    watchers, which name the directory on their command line) are gone."""
    import glob

    pattern = os.path.join(tempfile.gettempdir(), f"sparktrain-{run_id}-r*")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in psutil.process_iter(["cmdline", "status"])
                 if f"sparktrain-{run_id}-" in " ".join(p.info["cmdline"] or []) and p.info["status"] != "zombie"]
        if not alive:
            break
        time.sleep(0.05)
    return glob.glob(pattern)


def wait_forever(outdir: str) -> None:
    wait_for_file(os.path.join(outdir, "never"), timeout=170)


# -- a rank raises ---------------------------------------------------------------------------------

def raise_at(point: str, outdir: str):
    import sparktrain

    record_rank(outdir)
    failing = sparktrain.rank() == 1
    if failing:
        wait_for_ranks(outdir, sparktrain.size())
    if point == "before_init":
        if failing:
            mark_time(outdir, "raised")
            raise RuntimeError("rank 1 fails before init")
        wait_forever(outdir)
    import keras

    import sparktrain.keras as hvd

    hvd.init(timeout=60)
    if point == "after_init":
        if failing:
            mark_time(outdir, "raised")
            raise RuntimeError("rank 1 fails after init")
        import tensorflow as tf

        hvd.allreduce(tf.constant(1.0))  # waits in a collective for rank 1, which never comes
        wait_forever(outdir)

    class Fail(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if failing and self.epoch == 1 and batch == 3:
                mark_time(outdir, "raised")
                raise RuntimeError("rank 1 fails mid-epoch")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    from helpers import digits

    (x, y), _ = digits(hvd.rank(), hvd.size())
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=3, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Fail()])


@pytest.mark.parametrize("point", ["before_init", "after_init", "mid_epoch"])
def test_a_rank_that_raises_fails_the_run_with_its_traceback(spark, tmp_path, point):
    outdir = str(tmp_path)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(raise_at, args=(point, outdir), num_proc=3, env=ENV, verbose=0)
    failed_at = time.time()
    root = e.value.root_cause
    wanted = f"rank 1 fails {point.replace('_', '-') if point == 'mid_epoch' else point.replace('_', ' ')}"
    assert (root.rank, root.exc_type, root.message) == (1, "RuntimeError", wanted)
    assert f'raise RuntimeError("{wanted}")' in root.traceback
    assert "Remote traceback (rank 1)" in str(e.value)
    assert wait_pids_gone(run_pids(outdir, 3), timeout=5) == []
    fault_time(f"rank raises {point.replace('_', ' ')}", 15, failed_at - read_time(outdir, "raised"))


# -- a rank exits hard -----------------------------------------------------------------------------

def exit_hard(how: str, outdir: str):
    import sparktrain

    record_rank(outdir)
    if sparktrain.rank() == 1:
        wait_for_ranks(outdir, sparktrain.size())
        mark_time(outdir, "raised")
        if how == "exit3":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    wait_forever(outdir)


@pytest.mark.parametrize("how, headline", [("exit3", "exited with code 3"), ("sigkill", "killed by SIGKILL")])
def test_a_rank_that_exits_hard_is_reported_and_the_others_stopped(spark, tmp_path, how, headline):
    outdir = str(tmp_path)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(exit_hard, args=(how, outdir), num_proc=3, verbose=0)
    failed_at = time.time()
    root = e.value.root_cause
    assert root.rank == 1 and root.exitcode == (3 if how == "exit3" else -signal.SIGKILL)
    assert headline in str(e.value).splitlines()[0]
    assert wait_pids_gone(run_pids(outdir, 3), timeout=5) == []
    fault_time(f"rank exits hard ({how})", 15, failed_at - read_time(outdir, "raised"))


# -- a rank hangs --------------------------------------------------------------------------------------

def hang_outside_collective(outdir: str):
    import tensorflow as tf

    import sparktrain.tensorflow as hvd

    hvd.init(timeout=4)
    record_rank(outdir)
    if hvd.rank() == 1:
        wait_forever(outdir)  # alive, but never joins the collective
    mark_time(outdir, f"entered-{hvd.rank()}")
    return hvd.allreduce(tf.constant(1.0)).numpy()


def test_a_rank_that_never_joins_a_collective_fails_the_others_within_its_timeout(spark, tmp_path):
    outdir = str(tmp_path)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(hang_outside_collective, args=(outdir,), num_proc=3, env=ENV, verbose=0)
    failed_at = time.time()
    root = e.value.root_cause
    assert root.rank in (0, 2), root
    said = " ".join([root.exc_type, root.message, *root.output_tail])
    # TensorFlow's ring says DeadlineExceeded; the native engine names the rank that never came, in
    # the first rank to time out ("timed out after 4 s waiting for rank 1") and in the others that saw
    # it, whichever of them reached the driver first ("rank 1 never reached the collective in time
    # (another rank on this host saw it first)").
    assert ("deadline" in said.lower() or "timed out" in said
            or "rank 1 never reached the collective in time" in said), said
    assert wait_pids_gone(run_pids(outdir, 3), timeout=5) == []
    entered = min(read_time(outdir, f"entered-{r}") for r in (0, 2))
    fault_time("rank never joins a collective (timeout 4 s)", 4 + 15, failed_at - entered)


def test_a_rank_that_hangs_in_user_code_is_ended_by_the_run_timeout(spark, tmp_path):
    outdir = str(tmp_path)
    started = time.monotonic()
    with pytest.raises(sparktrain.RunTimeoutError, match="timeout=3 s") as e:
        sparktrain.run(lambda: (record_rank(outdir), wait_forever(outdir)), num_proc=3, timeout=3, verbose=0)
    # On a loaded machine a rank may still be starting when the 3 s are up, before it could write
    # its pid: count every process of this run by its work directory's name instead.
    run_id = re.search(r"^run (\w+) of ", str(e.value)).group(1)
    assert wait_pids_gone([r["pid"] for r in read_ranks(outdir).values()], timeout=5) == []
    assert rank_processes(f"sparktrain-{run_id}-") == [] and leftovers(run_id) == []
    fault_time("rank hangs in user code, timeout=3 s", 3 + 15, time.monotonic() - started)


# -- cancellation and dead parents ----------------------------------------------------------------------

def _when_all_started(outdir: str, size: int, then) -> threading.Thread:
    def go():
        for r in range(size):
            wait_for_file(os.path.join(outdir, f"rank-{r}.json"), timeout=60)
        mark_time(outdir, "acted")
        then(read_ranks(outdir))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("how", ["cancelJobGroup", "KeyboardInterrupt"])
def test_cancelling_the_run_ends_every_rank_process(spark, tmp_path, how):
    import _thread

    outdir = str(tmp_path)

    def cancel(ranks):
        if how == "cancelJobGroup":
            spark.sparkContext.cancelJobGroup(f"sparktrain-{ranks[0]['env']['SPARKTRAIN_RUN_ID']}")
        else:
            _thread.interrupt_main()  # what a notebook's stop button does

    t = _when_all_started(outdir, 3, cancel)
    expected = sparktrain.RunCancelledError if how == "cancelJobGroup" else KeyboardInterrupt
    try:
        with pytest.raises(expected):
            sparktrain.run(lambda: (record_rank(outdir), wait_forever(outdir)), num_proc=3, verbose=0)
    finally:
        t.join(60)
    assert wait_pids_gone(run_pids(outdir, 3), timeout=5) == []
    fault_time(f"cancel with {how}: every rank process gone", 5, time.time() - read_time(outdir, "acted"))
    assert leftovers(read_ranks(outdir)[0]["env"]["SPARKTRAIN_RUN_ID"]) == []
    assert sparktrain.run(lambda: sparktrain.rank(), num_proc=3, verbose=0) == 0  # the session is fine


def test_killing_a_ranks_pyspark_worker_kills_its_training_process(spark, tmp_path):
    outdir = str(tmp_path)
    t = _when_all_started(outdir, 3, lambda ranks: os.kill(ranks[1]["ppid"], signal.SIGKILL))
    try:
        with pytest.raises(sparktrain.RankFailedError) as e:
            sparktrain.run(lambda: (record_rank(outdir), wait_forever(outdir)), num_proc=3, verbose=0)
    finally:
        t.join(60)
    failed_at = time.time()
    assert e.value.root_cause.rank == 1
    assert "Python worker exited unexpectedly" in e.value.root_cause.message
    assert wait_pids_gone(run_pids(outdir, 3), timeout=5) == []
    assert leftovers(read_ranks(outdir)[0]["env"]["SPARKTRAIN_RUN_ID"]) == []  # the watcher removed it
    fault_time("PySpark worker SIGKILLed: run fails", 15, failed_at - read_time(outdir, "acted"))


# -- concurrency and soak ---------------------------------------------------------------------------------

def tagged(tag: str, outdir: str):
    import json
    import os

    import sparktrain

    record_rank(outdir, tag=f"-{tag}")
    print(f"output of {tag} from rank {sparktrain.rank()}")
    return {"tag": tag, "run_id": os.environ["SPARKTRAIN_RUN_ID"],
            "ports": [w.rsplit(":", 1)[1] for w in json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]]}


def test_two_concurrent_runs_in_one_session_keep_to_themselves(spark, tmp_path):
    outdir = str(tmp_path)
    results, outputs, errors = {}, {}, []

    def one(tag):
        out = io.StringIO()
        try:
            results[tag] = sparktrain.run(tagged, args=(tag, outdir), num_proc=2, stdout=out, verbose=0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        outputs[tag] = out.getvalue()

    threads = [threading.Thread(target=one, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert errors == [] and sorted(results) == ["a", "b"]
    assert results["a"]["run_id"] != results["b"]["run_id"]
    assert not set(results["a"]["ports"]) & set(results["b"]["ports"])
    for tag, other in (("a", "b"), ("b", "a")):
        assert results[tag]["tag"] == tag
        lines = outputs[tag].splitlines()
        assert sorted(lines) == [f"[0]<stdout>:output of {tag} from rank 0", f"[1]<stdout>:output of {tag} from rank 1"]


def _resources(run_ids: list[str]) -> dict:
    """What the runs ``run_ids`` could leak in the driver process and on this machine. Only their
    own rank processes and temp dirs count: another sparktrain run may share the machine."""
    me = psutil.Process()
    return {
        # (name, ident) pairs: a thread of an earlier test may end meanwhile; only new ones leak.
        "threads": {(t.name, t.ident) for t in threading.enumerate()},
        "fds": me.num_fds(),
        "listening": sorted(c.laddr.port for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN),
        "rank processes": [pid for run_id in run_ids for pid in rank_processes(f"sparktrain-{run_id}-")],
        "temp dirs": sorted(n for n in os.listdir(tempfile.gettempdir())
                            if any(n.startswith(f"sparktrain-{run_id}-") for run_id in run_ids)),
    }


def _noop_run_id(i: int = 0):
    return i, os.getpid(), os.environ["SPARKTRAIN_RUN_ID"]


def test_twenty_runs_in_a_row_leak_nothing(spark):
    warm = sparktrain.run(_noop_run_id, num_proc=3, verbose=0)  # Spark's own threads and workers start once
    before = _resources([warm[2]])
    pids, run_ids = [], []
    for i in range(20):
        value, pid, run_id = sparktrain.run(_noop_run_id, args=(i,), num_proc=3, verbose=0)
        assert value == i
        assert rank_processes(f"sparktrain-{run_id}-") == []  # no rank or watcher outlives its run
        pids.append(pid)
        run_ids.append(run_id)
    assert len(set(pids)) == 20  # a fresh process every time
    assert wait_pids_gone(pids, timeout=5) == []
    after = _resources(run_ids)
    # Py4J opens and closes its own connections as threads come and go; a leak per run would
    # show as 20 or more.
    assert after.pop("fds") - before.pop("fds") <= 2
    assert sorted(name for name, _ in after.pop("threads") - before.pop("threads")) == []
    assert after == before


def test_storage_options_the_executor_cannot_unpickle_are_reported_as_such(spark, tmp_path):
    """The run's storage_options hold an object of a module only the driver can import: the rank
    reports it as it reports a train_fn it cannot unpickle, naming the options and the fix. The
    options reach every rank whether or not the run has a home (no elastic_url here)."""
    import sys

    module = tmp_path / "driver_only_module.py"
    module.write_text("class Token:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import driver_only_module

        with pytest.raises(sparktrain.RankFailedError) as e:
            sparktrain.run(lambda: 0, num_proc=2, verbose=0, storage_options={"token": driver_only_module.Token()})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("driver_only_module", None)
    text = str(e.value)
    assert "could not unpickle the run's storage_options on this executor" in text, text
    assert "No module named 'driver_only_module'" in text and "Install the same packages" in text
