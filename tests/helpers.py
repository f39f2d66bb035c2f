"""Training functions and checks shared by the integration tests.

Functions here are imported by reference on the executors (tests/ is on their sys.path
through the child's PYTHONPATH), the way a user's own module would be.
"""
from __future__ import annotations

import json
import os
import time

import psutil


def record_rank(outdir: str, tag: str = "", **extra) -> dict:
    """Write what this rank sees to outdir/rank-<rank>.json and return it."""
    import sparktrain

    info = {
        "rank": sparktrain.rank(), "size": sparktrain.size(), "local_rank": sparktrain.local_rank(),
        "local_size": sparktrain.local_size(), "cross_rank": sparktrain.cross_rank(),
        "cross_size": sparktrain.cross_size(), "pid": os.getpid(), "ppid": os.getppid(), "tag": tag,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("SPARKTRAIN_", "MY_")) or k in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                                 "CUDA_VISIBLE_DEVICES")},
        **extra,
    }
    path = os.path.join(outdir, f"rank-{info['rank']}{tag}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    return info


def read_ranks(outdir: str, tag: str = "") -> dict[int, dict]:
    out = {}
    for name in os.listdir(outdir):
        if name.startswith("rank-") and name.endswith(f"{tag}.json") and (tag or name.count("-") == 1):
            with open(os.path.join(outdir, name)) as f:
                info = json.load(f)
            out[info["rank"]] = info
    return out


def wait_pids_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait (bounded) until none of ``pids`` is alive; returns the ones still alive."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_until(predicate, timeout: float, what: str) -> None:
    """Wait for ``predicate()`` to hold, checking every 50 ms; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.05)


def wait_for_file(path: str, timeout: float = 60.0) -> None:
    """Block until ``path`` exists (a rank signalling a test); fails loudly on timeout."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def wait_for_ranks(outdir: str, size: int, timeout: float = 120.0) -> None:
    """Block until every rank has written its ``record_rank`` file. A rank about to fail on purpose
    waits for this first, so that the test can read every rank's pid however slowly the others start."""
    for r in range(size):
        wait_for_file(os.path.join(outdir, f"rank-{r}.json"), timeout)


def rank_processes(marker: str, timeout: float = 5.0) -> list[int]:
    """Pids of sparktrain rank processes (ranks and their watchers) whose command line contains
    ``marker`` (a run's work directory prefix, ``sparktrain-<run id>-``, or a work directory), still
    alive after waiting up to ``timeout`` s for them to go: a watcher notices that its rank's task
    cleaned up within a poll interval. The marker keeps other runs on this machine out of the count."""
    deadline = time.monotonic() + timeout
    while True:
        out = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            cmd = " ".join(p.info["cmdline"] or [])
            sparktrains = ("sparktrain.executor.child", "sparktrain.executor.watcher", "sparktrain/executor/watcher.py")
            if any(s in cmd for s in sparktrains) and marker in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.info["pid"])
        if not out or time.monotonic() >= deadline:
            return out
        time.sleep(0.05)


def run_marker(info: dict) -> str:
    """What the processes and work directories of the run that ``record_rank`` saw have in their names."""
    return f"sparktrain-{info['env']['SPARKTRAIN_RUN_ID']}-"


def fault_time(scenario: str, bound: float, seconds: float) -> None:
    """Record a measured time for the fault-bounds benchmark (only when it asked for them)."""
    path = os.environ.get("SPARKTRAIN_FAULT_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, "bound": bound, "seconds": seconds}) + "\n")


def mark_time(outdir: str, name: str) -> None:
    with open(os.path.join(outdir, name + ".tmp"), "w") as f:
        f.write(repr(time.time()))
    os.replace(os.path.join(outdir, name + ".tmp"), os.path.join(outdir, name))


def read_time(outdir: str, name: str) -> float:
    with open(os.path.join(outdir, name)) as f:
        return float(f.read())


from sparktrain.cli.demo import digits  # noqa: E402,F401 - the demo's data loader, shared by the tests


def same_on_every_rank(ranks: dict[int, dict], key: str):
    """What every rank recorded under ``key``, asserted to be the same everywhere."""
    values = {repr(got[key]) for got in ranks.values()}
    assert len(values) == 1, (key, values)
    return ranks[0][key]


def weights_digest(weights) -> str:
    import hashlib

    import numpy as np

    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()


def assert_collectives(ranks: dict[int, dict]) -> None:
    """Check what ``collectives`` (tests/test_keras.py) recorded on each of 3 ranks, on any engine."""
    base = [[0, 1, 2], [3, 4, 5]]
    for r, info in ranks.items():
        got = info["got"]
        for dtype in ("float32", "float64", "int32"):
            assert got[f"sum_{dtype}"] == [[3 * v + 3 for v in row] for row in base], (r, dtype)
            assert got[f"avg_{dtype}"] == [[v + 1 for v in row] for row in base], (r, dtype)
            assert got[f"gather_{dtype}"] == [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]], (r, dtype)
            assert got[f"bcast_{dtype}"] == [[1, 1], [1, 1]], (r, dtype)
        # Last step: x = rank + 2 on each rank.
        assert got["graph"] == [[9.0], [2.0, 3.0, 4.0], [4.0]], r
        assert got["variable"] == [2.0, 2.0, 2.0], r
        assert got["thread_growth"] < 50, (r, got["thread_growth"])  # 900 collectives ran


def plain(a) -> list:
    """An array (or tensor's numpy value) as a JSON-able list: bools as they are, numbers as floats."""
    import numpy as np

    a = np.asarray(a)
    return a.tolist() if a.dtype == bool else a.astype(np.float64).tolist()


def recorder(got: dict, rank: int):
    """``put(case, fn)``: records ``fn()`` in ``got[case]`` as plain lists (tensors, or a list of
    them), or ``"ERROR <class>: <message>"`` if it raised, which also goes to the rank's stderr."""
    import sys

    def put(case, fn):
        try:
            value = fn()
            if isinstance(value, (list, tuple)):
                got[case] = [plain(v.numpy()) if hasattr(v, "numpy") else v for v in value]
            else:
                got[case] = plain(value.numpy()) if hasattr(value, "numpy") else value
        except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
            got[case] = f"ERROR {type(e).__name__}: {e}"
            print(f"rank {rank} {case}: {got[case][:300]}", file=sys.stderr)  # in the rank's output if it fails

    return put



# -- Keras 3 on JAX -----------------------------------------------------------------------------------

def skip_without_jax() -> None:
    """Skip the calling test module where jax or Keras 3 is not installed. Neither is imported:
    importing jax sets TF_CPP_MIN_LOG_LEVEL=1 in this process (which every later run's ranks would
    inherit), and Keras would load TensorFlow."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("keras") is None:
        pytest.skip("the JAX tests need jax and keras 3: pip install sparktrain[jax]", allow_module_level=True)


def digits_mlp():
    """The JAX tests' model: an MLP for the 64 pixels of the 8x8 digits, compiled with Adam."""
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def digits_mlp_accuracy(weights, x, y) -> float:
    """:func:`digits_mlp`'s accuracy on ``(x, y)`` from its weights, in numpy (no Keras here)."""
    import numpy as np

    w1, b1, w2, b2 = weights
    return float(np.mean(np.argmax(np.maximum(x @ w1 + b1, 0) @ w2 + b2, axis=1) == y))


def handed_env(env: dict, conf: dict, environ: dict | None = None) -> dict:
    """The settings' environment the ranks get, as ``run`` resolves it on the driver from ``env=``,
    the driver's environment ``environ`` and the Spark ``conf`` (``driver.launch.taskspec.settings_env``)."""
    from types import SimpleNamespace

    from sparktrain import settings
    from sparktrain.driver.launch import config, taskspec

    values = config.settings_of(conf, {**(environ or {}), **env})
    cfg = SimpleNamespace(args=SimpleNamespace(env=env), settings=values,
                          encrypted=settings.encrypts(values.encryption, conf))
    return taskspec.settings_env(cfg)


def committed_alone(path: str) -> bool:
    """Whether the local object ``path`` and its manifest are all its folder holds: no partial write is left."""
    from sparktrain import storage

    name = os.path.basename(path)
    return sorted(os.listdir(os.path.dirname(path))) == [name, name + storage.MANIFEST_SUFFIX]
