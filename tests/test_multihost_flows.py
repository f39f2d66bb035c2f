"""The slow multi-host tier: the real flows of a cluster, each its own Spark application on a
standalone cluster of simulated hosts whose workers offer 2 fake GPUs each. Every driver is a
process of its own (spark-submit, or a Spark Connect client), as on a real cluster.

Not in ``.ci/run``: ``pytest -m "multihost and slow" -n 0`` runs it (docs/architecture.md, "Tests")."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import simhosts
from connect_server import ConnectServer, needs_server
from multihost_cluster import MARKS
from standalone import Standalone

pytestmark = [*MARKS, pytest.mark.slow]

HOSTS, PER_HOST, GPUS = 2, 2, 2
HERE = os.path.dirname(os.path.abspath(__file__))

#: One rank's line: its rank, local rank, hostname and GPUs.
WHERE = textwrap.dedent("""
    import os, socket, sparktrain
    print(f"RANK {sparktrain.rank()} {sparktrain.local_rank()} {socket.gethostname()} "
          f"{os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
""")


@pytest.fixture(scope="module")
def gpu_cluster():
    hosts = simhosts.SimHosts(HOSTS).up()
    standalone = None
    try:
        standalone = Standalone(hosts, cores=PER_HOST, gpus=GPUS).start()
        yield hosts, standalone
    finally:
        if standalone is not None:
            standalone.stop()
        left = hosts.down()
    assert not left, left


def _env() -> dict:
    paths = [HERE, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                PYTHONPATH=os.pathsep.join(paths))


def _submit(standalone: Standalone, args: list[str], conf: dict | None = None, cwd=None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """spark-submit against the standalone master, the driver on the hosts' bridge."""
    import pyspark

    settings = {**standalone.session_conf(), "spark.ui.enabled": "false", **(conf or {})}
    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    argv = [submit, "--master", standalone.url, *[a for k, v in settings.items() for a in ("--conf", f"{k}={v}")], *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=cwd, env={**_env(), **(env or {})})


def _ranks(out: str) -> dict[int, tuple[int, str, str]]:
    """{rank: (local rank, hostname, CUDA_VISIBLE_DEVICES)} from the ranks' RANK lines."""
    found = re.findall(r"^\[\d+\]<stdout>:RANK (\d+) (\d+) (\S+) (\S+)$", out, re.M)
    return {int(r): (int(lr), host, gpus) for r, lr, host, gpus in found}


def _by_host(ranks: dict, hosts) -> None:
    """Ranks are contiguous per host, with local ranks 0.. on each."""
    n = HOSTS * PER_HOST
    assert sorted(ranks) == list(range(n)), ranks
    for r, (local, host, _) in ranks.items():
        assert host in hosts.names and local == r % PER_HOST, ranks
        assert ranks[r - local][1] == host, ranks


@pytest.mark.timeout(300)
def test_sparktrain_run_through_spark_submit_gives_each_rank_a_gpu_of_its_host(gpu_cluster, tmp_path):
    """`spark-submit --master spark://... "$(sparktrain submit-file)" run train.py --gpu`: each
    worker offers 2 fake GPUs, each rank's task holds one, and the two ranks of a host see
    different ones."""
    from sparktrain.cli import submit_file

    hosts, standalone = gpu_cluster
    (tmp_path / "train.py").write_text(WHERE)
    proc = _submit(standalone, [submit_file(), "run", "train.py", "--num-proc", str(HOSTS * PER_HOST), "--gpu"],
                   conf={"spark.executor.resource.gpu.amount": str(GPUS), "spark.task.resource.gpu.amount": "1"},
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = _ranks(proc.stdout)
    _by_host(ranks, hosts)
    for r in range(0, HOSTS * PER_HOST, PER_HOST):
        assert sorted(ranks[r + k][2] for k in range(PER_HOST)) == ["0", "1"], ranks


MLFLOW_DRIVER = textwrap.dedent("""
    import sys
    import mlflow
    import sparktrain
    from pyspark.sql import SparkSession

    SparkSession.builder.getOrCreate()

    def log_from_rank_0():
        import socket
        import mlflow
        import sparktrain
        if sparktrain.rank() == 0:  # into the driver's run, through sparktrain's hand-off
            mlflow.log_metric("rank0_metric", 1.5)
            mlflow.log_param("rank0_host", socket.gethostname())
        return sparktrain.rank()

    mlflow.set_tracking_uri(sys.argv[1])
    mlflow.set_experiment("multihost")
    with mlflow.start_run() as run:
        sparktrain.run(log_from_rank_0, num_proc=4, verbose=0)
    print("MLFLOW_RUN", run.info.run_id)
""")


@pytest.mark.timeout(300)
def test_rank_0_on_a_host_logs_into_the_drivers_mlflow_run(gpu_cluster, tmp_path):
    """A driver under spark-submit with an MLflow run, the tracking server on the driver's host:
    rank 0, on a simulated host, logs through the bridge into that run."""
    pytest.importorskip("mlflow")
    import mlflow

    from mlflow_server import MlflowServer

    hosts, standalone = gpu_cluster
    server = MlflowServer(host=hosts.driver_ip)
    server.start()
    try:
        (tmp_path / "driver.py").write_text(MLFLOW_DRIVER)
        proc = _submit(standalone, ["driver.py", server.uri], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run_id = re.search(r"^MLFLOW_RUN (\w+)$", proc.stdout, re.M).group(1)
        run = mlflow.MlflowClient(server.uri).get_run(run_id)
        assert run.data.metrics["rank0_metric"] == 1.5
        assert run.data.params["rank0_host"] in hosts.names
    finally:
        server.stop()
        import shutil

        shutil.rmtree(server.workdir, ignore_errors=True)


CONNECT_CLIENT = textwrap.dedent("""
    import sys
    import sparktrain
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()

    def where():
        import os, socket, sparktrain
        print(f"RANK {sparktrain.rank()} {sparktrain.local_rank()} {socket.gethostname()} "
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
        return sparktrain.rank()

    print("RESULT", sparktrain.run(where, num_proc=4, verbose=1))
""")


@pytest.mark.timeout(300)
@needs_server
def test_a_connect_client_runs_ranks_on_the_hosts_behind_a_connect_server(gpu_cluster, tmp_path):
    """A Spark Connect server in front of the standalone cluster, on the driver's host; a client
    process runs 4 ranks on the simulated hosts, which reach the client and stream its output."""
    hosts, standalone = gpu_cluster
    conf = {**standalone.session_conf(), "spark.ui.enabled": "false"}
    server = ConnectServer(master=standalone.url, conf=conf, host=hosts.driver_ip)
    try:
        (tmp_path / "client.py").write_text(CONNECT_CLIENT)
        proc = subprocess.run([sys.executable, "client.py", server.url], capture_output=True, text=True, timeout=240,
                              cwd=tmp_path, env=_env())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server.output()[-3000:]
        assert "RESULT 0" in proc.stdout.splitlines()
        _by_host(_ranks(proc.stdout), hosts)
        # The ranks reached this client (its address on the bridge) and streamed their lines live.
        assert f"executors can reach this client at {hosts.driver_ip}" in proc.stderr, proc.stderr[-3000:]
    finally:
        server.stop()
