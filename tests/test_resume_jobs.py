"""A named run across spark-submit jobs, on local files, S3 (moto) and ADLS (Azurite): job 1 is
killed with SIGKILL in epoch 3 of 6 while a second driver on its run is refused; job 2 takes over
the expired lease, resumes from the last commit and ends with the weights of an uninterrupted run;
job 3 returns job 2's result at once, starting no rank. Through ``run`` on every store and through
``run_elastic`` on local files. Each job is one spark-submit of tests/resume_job.py on local[2]."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

import sparktrain
from helpers import wait_pids_gone
from storage_servers import fresh_place
from sparktrain.storage import home as homes, lease as leases

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]  # by hand: bash tests/run slow

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_job.py")
RUN = "victim"


def _credentials(options: dict | None) -> dict[str, str]:
    """The environment through which a job's driver and ranks reach the store of ``options``."""
    if not options:
        return {}
    if "connection_string" in options:
        return {"AZURE_STORAGE_ACCOUNT_NAME": options["account_name"],
                "AZURE_STORAGE_CONNECTION_STRING": options["connection_string"]}
    client = options["client_kwargs"]
    return {"AWS_ACCESS_KEY_ID": options["key"], "AWS_SECRET_ACCESS_KEY": options["secret"],
            "AWS_DEFAULT_REGION": client["region_name"], "AWS_ENDPOINT_URL": client["endpoint_url"]}


def _submit(tmp_path, api: str, job: str, run_id: str, url: str, out: str, creds: dict,
            kill_in_epoch: int | None = None) -> subprocess.Popen:
    import pyspark

    spark_submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, **creds)
    args = [api, job, run_id, url, out] + ([str(kill_in_epoch)] if kill_in_epoch is not None else [])
    with open(os.path.join(out, f"submitted-{job}"), "w") as f:
        f.write(repr(time.time()))
    log = open(tmp_path / f"job-{job}.log", "w")
    return subprocess.Popen([spark_submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false", JOB, *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def _finish(tmp_path, proc: subprocess.Popen, job: str) -> str:
    proc.wait(timeout=300)
    text = (tmp_path / f"job-{job}.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _read(out: str, name: str) -> str:
    with open(os.path.join(out, name)) as f:
        return f.read()


def _seconds(out: str, since: str, until: str) -> float:
    return float(_read(out, until)) - float(_read(out, since))


def _wait_for(path: str, proc: subprocess.Popen, log, timeout: float) -> None:
    """Until ``path`` exists; fails at once, with the job's log, if the job ended first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        try:
            proc.wait(timeout=0.1)  # the job's end is the other event waited on
        except subprocess.TimeoutExpired:
            assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
            continue
        pytest.fail(f"the job ended ({proc.returncode}) before {path} appeared:\n{log.read_text()[-4000:]}")


def _ours(pid: int, job: subprocess.Popen) -> psutil.Process:
    """The process ``pid``, proven to be a descendant of ``job`` (the spark-submit this test started)."""
    proc = psutil.Process(pid)
    assert job.pid in {p.pid for p in proc.parents()}, f"{pid} is not under spark-submit {job.pid}"
    return proc


def _weights(out: str, job: str):
    import numpy as np

    return [np.array(w) for w in json.loads(_read(out, f"weights-{job}.json"))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run under another run_id, in a job of its own: ``(weights, seconds from
    the call to rank 0's first step, from the submit to it, from ``@hvd.elastic.run``'s call to it)``."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "out"
    out.mkdir()
    _finish(tmp, _submit(tmp, "run", "ref", "reference", f"file://{tmp}/runs", str(out), {}), "ref")
    assert _read(str(out), "epochs-ref").split() == ["0", "1", "2", "3", "4", "5"]
    return (_weights(str(out), "ref"), _seconds(str(out), "called-ref", "first-step-ref"),
            _seconds(str(out), "submitted-ref", "first-step-ref"), _seconds(str(out), "entered-ref", "first-step-ref"))


def never(flag: str) -> None:
    open(flag, "w").close()  # the second driver was let in: the test fails on this file


@pytest.mark.parametrize("api,store", [("run", "file"), ("run", "s3"), ("run", "abfs"), ("run_elastic", "file")],
                         ids=["file", "s3", "abfs", "run_elastic-file"])
def test_a_killed_job_resumes_in_a_new_job_and_a_finished_run_returns_at_once(request, tmp_path, api, store,
                                                                              reference):
    import numpy as np

    url, options = fresh_place(request, store, tmp_path, "runs")
    creds, out = _credentials(options), str(tmp_path / "out")
    os.makedirs(out)
    home = homes.Home(url, RUN, options)
    first = _submit(tmp_path, api, "first", RUN, url, out, creds, kill_in_epoch=3)
    _wait_for(os.path.join(out, "in-epoch"), first, tmp_path / "job-first.log", timeout=300)
    driver = _ours(int(_read(out, "driver-first.pid")), first)
    ranks = [int(_read(out, f"rank-first-{r}.pid")) for r in (0, 1)]

    # Two drivers on one run at once: the second (this test's process) is refused, naming the first.
    flag = str(tmp_path / "second-driver-ran")
    with pytest.raises(sparktrain.errors.RunInUseError) as refused:
        sparktrain.run(never, args=(flag,), num_proc=-1, run_id=RUN, storage_options=options, verbose=0,
                       env={"SPARKTRAIN_ELASTIC_URL": url, "SPARKTRAIN_LEASE_TIMEOUT": "9"})
    assert refused.value.holder["pid"] == driver.pid and f"pid {driver.pid}" in str(refused.value)
    assert not os.path.exists(flag)

    driver.kill()  # SIGKILL, during epoch 3
    first.wait(timeout=60)
    assert wait_pids_gone(ranks, timeout=60) == []  # no rank of the killed job lives on
    assert home.last_commit()["epoch"] == 3 and home.result() == (False, None)
    fs, path = sparktrain.storage.filesystem(home.url, options)
    fs.invalidate_cache()
    assert not [n for n in fs.ls(path, detail=False) if ".partial-" in n]  # nothing half-written
    killed = home.lease_record()
    assert killed["pid"] == driver.pid and not killed["released"]
    deadline = time.monotonic() + 60  # the lease expires on its own, LEASE_TIMEOUT after its last renewal
    while leases.live(home.lease_record()):
        assert time.monotonic() < deadline, home.lease_record()
        time.sleep(0.2)  # the expiry is a wall-clock time written in the lease: nothing else to wait on

    second = _finish(tmp_path, _submit(tmp_path, api, "second", RUN, url, out, creds), "second")
    takeover = next((line for line in second.splitlines() if "this driver takes it over" in line), "")
    assert "expired" in takeover and f"pid {driver.pid}" in takeover, second[-4000:]
    assert "resumes from its last commit (epoch 3, batch 0)" in second
    assert _read(out, "epochs-second").split() == ["3", "4", "5"]  # its first epoch is not 0
    for got, want in zip(_weights(out, "second"), reference[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert home.state() == "finished" and home.lease_record()["released"]

    third = _finish(tmp_path, _submit(tmp_path, api, "third", RUN, url, out, creds), "third")
    assert "finished before; returning its recorded result, launching no rank" in third
    assert not [n for n in os.listdir(out) if n.startswith(("rank-third-", "epochs-third"))]  # no rank started
    assert json.loads(_read(out, "weights-third.json")) == json.loads(_read(out, "weights-second.json"))
    returned = _seconds(out, "called-third", "returned-third")
    assert returned < 30, returned  # the recorded result, read from the home: no stage, no rank
    resumed = _seconds(out, "called-second", "first-step-second")
    print(f"\n[{request.node.callspec.id}] seconds to rank 0's first step, fresh run / resumed run: from the call "
          f"{reference[1]:.1f} / {resumed:.1f}, from the submit {reference[2]:.1f} / "
          f"{_seconds(out, 'submitted-second', 'first-step-second'):.1f}, from @hvd.elastic.run's call (the "
          f"commit read and synced) {reference[3]:.2f} / {_seconds(out, 'entered-second', 'first-step-second'):.2f}; "
          f"a finished run's call returned in {returned:.2f}")
