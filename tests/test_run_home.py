"""A run's home on real stores: local files, S3 on moto's server, ADLS on Azurite. The lease's
conditional writes (one of two racing drivers wins; a live lease is refused naming its holder; an
expired one is taken over), the recorded result (whole or nothing), and ``sparktrain runs``."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from sparktrain import storage
from storage_servers import fresh_place
from sparktrain.errors import InvalidArgumentError, RunInUseError
from sparktrain.storage import conditional, home as homes, lease as leases

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["file", "s3", "abfs"])
def base(request, tmp_path):
    """(elastic_url, storage_options) of a fresh, empty place on each store."""
    return fresh_place(request, request.param, tmp_path, "runs")


def test_conditional_writes_create_once_and_replace_only_the_version_read(base):
    url, options = base
    target = homes.Home(url, "r").file(homes.LEASE)
    assert conditional.atomic(target, options)
    assert conditional.read(target, options) is None
    assert conditional.create(target, b"one", options)
    assert not conditional.create(target, b"two", options)  # one is there: refused
    data, version = conditional.read(target, options)
    assert data == b"one"
    assert conditional.replace(target, b"three", version, options)
    assert not conditional.replace(target, b"four", version, options)  # no longer the version read
    assert conditional.read(target, options)[0] == b"three"


def test_of_drivers_racing_for_one_run_exactly_one_wins(base):
    url, options = base
    home = homes.Home(url, "race", options)
    won, refused = [], []
    start = threading.Barrier(4)

    def driver():
        lease = home.lease(60)
        start.wait(timeout=30)
        try:
            lease.acquire("race")
            won.append(lease.token)
        except RunInUseError as e:
            refused.append(e)

    threads = [threading.Thread(target=driver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(won) == 1 and len(refused) == 3, (won, refused)
    assert home.lease_record()["token"] == won[0]


def test_a_live_lease_is_refused_naming_its_holder_and_an_expired_one_is_taken_over(base):
    url, options = base
    home = homes.Home(url, "held", options)
    clock = [1000.0]
    first = leases.Lease(home.file(homes.LEASE), 30, options, clock=lambda: clock[0])
    first.acquire("held")
    second = leases.Lease(home.file(homes.LEASE), 30, options, clock=lambda: clock[0])
    with pytest.raises(RunInUseError) as refused:
        second.acquire("held")
    record = home.lease_record()
    assert refused.value.holder["pid"] == record["pid"] and f"pid {record['pid']}" in str(refused.value)
    assert f"host {record['host']}" in str(refused.value) and "started" in str(refused.value)
    clock[0] += 20
    assert first.renew()  # renewed: now it lasts until 1050
    clock[0] += 25
    with pytest.raises(RunInUseError):
        second.acquire("held")
    clock[0] += 10  # 1055: past the renewed expiry, the first driver is taken to be dead
    second.acquire("held")
    assert home.lease_record()["token"] == second.token
    assert not first.renew() and "another driver" in first.lost
    second.release()
    assert not leases.live(home.lease_record(), clock[0])
    third = leases.Lease(home.file(homes.LEASE), 30, options, clock=lambda: clock[0])
    third.acquire("held")  # a released lease is taken at once


def test_a_rank_reaches_the_home_the_driver_keeps(monkeypatch):
    """A rank's home (its elastic_url setting and elastic id, the run's storage options) is the
    driver's Home of the run: commits, backups and resize markers are where the driver looks."""
    from sparktrain.storage import rank as rank_storage

    monkeypatch.setenv("SPARKTRAIN_ELASTIC_URL", "s3://b/runs/")
    monkeypatch.setenv("SPARKTRAIN_ELASTIC_ID", "r")
    monkeypatch.setenv("SPARKTRAIN_ELASTIC_ATTEMPT", "3")
    mine, drivers = rank_storage.home(), homes.Home("s3://b/runs", "r")
    assert mine.url == drivers.url == "s3://b/runs/r"
    assert mine.state_url() == drivers.state_url() and mine.backup_url() == drivers.backup_url()
    assert mine.resize_marker(rank_storage.attempt()) == drivers.resize_marker(3) != drivers.resize_marker(4)
    assert len({mine.url, mine.state_url(), mine.backup_url(), mine.resize_marker(3),
                mine.file(homes.LEASE), mine.file(homes.RESULT)}) == 6
    monkeypatch.delenv("SPARKTRAIN_ELASTIC_URL")
    assert rank_storage.home() is None


def test_a_resize_marker_is_seen_with_its_reason_and_cleared_by_the_next_job(base):
    url, options = base
    home = homes.Home(url, "sized", options)
    assert home.resize_asked(1) is None
    home.commit(b"state", epoch=2, batch=5)
    home.mark_resize(1, "slots for 3 ranks for 60 s")
    assert homes.Home(url, "sized", options).resize_asked(1) == "slots for 3 ranks for 60 s"
    assert home.resize_asked(2) is None
    home.clear_markers()  # a new job numbers its attempts from 1 again
    assert home.resize_asked(1) is None
    assert home.committed() == b"state" and (home.last_commit()["epoch"], home.last_commit()["batch"]) == (2, 5)


def test_a_result_is_recorded_whole_and_the_home_tells_its_state(base):
    url, options = base
    home = homes.Home(url, "done", options)
    assert home.result() == (False, None) and home.state() == "failed"
    home.record_failure("RankFailedError: rank 1 failed")
    assert home.failure()["why"].startswith("RankFailedError")
    home.record_result({"weights": [1.0, 2.0]})
    assert home.result() == (True, {"weights": [1.0, 2.0]}) and home.state() == "finished"
    assert home.failure() is None
    fs, path = storage.filesystem(home.file(homes.RESULT), options)
    assert not [p for p in fs.ls(path.rsplit("/", 1)[0], detail=False) if ".partial-" in p]
    assert homes.run_ids(url, options) == ["done"]


RECORD_ELSEWHERE = """
import json, sys
from sparktrain.storage import home
home.Home(sys.argv[1], "elsewhere", json.loads(sys.argv[2])).record_result("from another process")
"""


def test_a_result_recorded_by_another_process_is_seen_after_this_one_listed_the_home(base):
    """A long-lived driver (a notebook's) that listed a run's home, and then another job finished
    the run: its next call sees the result, not its own listing of before (s3fs and adlfs cache
    listings, and answered "not found" from them)."""
    url, options = base
    home = homes.Home(url, "elsewhere", options)
    home.commit(b"commit", epoch=1, batch=0)
    home.clear_markers()  # lists the home, as a named run's driver does at its start
    assert home.result() == (False, None) and home.state() == "failed"
    subprocess.run([sys.executable, "-c", RECORD_ELSEWHERE, url, json.dumps(options)], check=True, timeout=120)
    assert home.state() == "finished" and home.result() == (True, "from another process")


@pytest.mark.parametrize("bad", ["a/b", "../up", "", "-x", "a b", 7, "x" * 200])
def test_a_bad_run_id_is_refused_naming_it_and_the_fix(bad):
    with pytest.raises(InvalidArgumentError) as e:
        homes.check_run_id(bad)
    assert repr(bad) in str(e.value) and "letters, digits" in str(e.value)


def test_sparktrain_runs_lists_each_run_with_its_state_commit_and_lease(tmp_path, capsys):
    from sparktrain.cli import main

    url = f"file://{tmp_path}/runs"
    done = homes.Home(url, "done")
    done.record_result(1)
    live = homes.Home(url, "live")
    live.commit(b"x", epoch=3, batch=0)
    lease = live.lease(60)
    lease.acquire("live")
    assert main(["runs", url]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"done", "live"}, out
    assert "finished" in rows["done"] and "running" in rows["live"]
    assert "epoch 3, batch 0" in rows["live"] and f"pid {lease.record()['pid']}" in rows["live"]
    assert main(["runs", url, "--json"]) == 0
    listed = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["live"]["last_commit"]["epoch"] == 3 and "token" not in listed["live"]["lease"]
