"""sparktrain.tune on a real local[4] Spark: trials as gangs of 2 real ranks, two at a time; the
same suggestion on every rank; pruning and failures; the slot arithmetic; a killed driver's study
finished by a second driver; an interrupted study; MLflow's nested runs; the dashboard in Chromium."""
from __future__ import annotations

import functools
import io
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

optuna = pytest.importorskip("optuna")

import sparktrain  # noqa: E402
import sparktrain.tune  # noqa: E402
from sparktrain.errors import InvalidArgumentError  # noqa: E402
from sparktrain.tune import slots  # noqa: E402
from sparktrain.tune.rank import Finished, Pruned  # noqa: E402

import tune_objectives as objectives  # noqa: E402
from conftest import HERE, module_spark  # noqa: E402
from helpers import wait_pids_gone  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

spark = module_spark("local[4]")

optuna.logging.set_verbosity(optuna.logging.WARNING)


# -- pure --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("concurrent, num_proc, slots_, gangs", [
    (None, 2, 4, 2), (None, 2, 5, 2), (None, 3, 4, 1), (2, 2, 4, 2), (1, 2, 4, 1), (None, 2, 0, 1), (3, 2, 0, 3),
])
def test_gangs_fit_the_slots(concurrent, num_proc, slots_, gangs):
    assert slots.concurrent_gangs(concurrent, num_proc, slots_) == gangs


@pytest.mark.parametrize("concurrent, num_proc, slots_, words", [
    (3, 2, 4, ["concurrent_trials=3", "num_proc=2", "6 task slots", "the cluster has 4", "2 or fewer"]),
    (None, 5, 4, ["num_proc=5", "needs 5 task slots", "the cluster has 4"]),
    (0, 2, 4, ["concurrent_trials must be a positive int", "got 0"]),
    (1.5, 2, 4, ["got 1.5"]),
])
def test_gangs_that_do_not_fit_are_refused_naming_both_numbers(concurrent, num_proc, slots_, words):
    with pytest.raises(InvalidArgumentError) as e:
        slots.concurrent_gangs(concurrent, num_proc, slots_)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("returned, error, state, value, message", [
    (Finished(0.5), None, "COMPLETE", 0.5, ""),
    (Finished([1.0, 2.0]), None, "COMPLETE", [1.0, 2.0], ""),
    (Pruned("pruned at step 3"), None, "PRUNED", None, "pruned at step 3"),
    (None, RuntimeError("\nrank 1 failed: boom\nmore"), "FAIL", None, "rank 1 failed: boom"),
    (b"bytes", None, "FAIL", None, "rank 0 returned bytes"),
])
def test_what_a_gangs_end_makes_of_its_trial(returned, error, state, value, message):
    got = slots.outcome(returned, error)
    assert (got.state, got.value) == (state, value) and message in got.message


def test_the_board_says_one_line_per_trial_event_and_keeps_one_table():
    from sparktrain.tune.board import Board

    out = io.StringIO()
    board = Board(out, "s", "minimize")
    board.started(0, 2, {})
    board.params(0, {"lr": 0.1})
    board.reported(0, 3, 0.5)
    board.stream(0).write("[0]<stdout>:epoch 3\n[0]<stdout>:part")
    board.ended(0, "COMPLETE", {"lr": 0.1}, 0.25, "", (0, 0.25))
    board.started(1, 2, {"lr": 0.2})
    board.ended(1, "PRUNED", {"lr": 0.2}, None, "pruned at step 1", (0, 0.25))
    lines = out.getvalue().splitlines()
    assert lines[0] == "sparktrain: tune: trial 0 started on 2 rank(s)"
    assert lines[1] == "[trial 0] [0]<stdout>:epoch 3"  # the unfinished line waits for its end
    assert lines[2].startswith("sparktrain: tune: trial 0 complete, value 0.25 after ") and \
        lines[2].endswith("with lr=0.1; best so far: trial 0, value 0.25")
    assert lines[3] == "sparktrain: tune: trial 1 started on 2 rank(s) with lr=0.2"
    assert "trial 1 pruned after" in lines[4] and ": pruned at step 1;" in lines[4] and len(lines) == 5
    text = board.text().splitlines()
    assert text[0] == "sparktrain.tune: study s (minimize), 0 running, 2 ended; best so far: trial 0, value 0.25"
    assert text[2].startswith("1 | pruned | lr=0.2 |") and text[3].startswith("0 | complete | lr=0.1 | 3 | 0.25 | 2 |")
    assert "<td>pruned</td>" in board.html() and "<script" not in board.html()


def test_the_study_server_answers_a_trials_ranks_in_process():
    """The driver's trial server and the ranks' RankTrial over real sockets, without Spark: one value
    per name, rank 0's reports recorded, one pruning answer per step (a rank asking first waits for
    rank 0's report), a wrong secret refused, a trial that ended refused."""
    import threading

    from sparktrain.tune.rank import RankTrial, StudyChannelError, TrialAddress, _Study
    from sparktrain.tune.server import TrialServer

    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=1.0))
    trial = study.ask()
    server = TrialServer("127.0.0.1", encrypted=False)
    reports = []
    address = TrialAddress(*server.address, server.secret, False, trial.number)
    try:
        with server.serve(trial, lambda n, step, value: reports.append((n, step, value))):
            ranks = [RankTrial(_Study(address, r), trial.number) for r in range(2)]
            x = [t.suggest_float("x", 0.0, 1.0) for t in ranks]
            assert x[0] == x[1] == trial.params["x"]
            assert ranks[1].suggest_categorical("c", ["a", "b"]) == ranks[0].suggest_categorical("c", ["a", "b"])
            ranks[1].report(5.0, 0)  # not recorded: rank 1's
            ranks[0].report(0.5, 0)
            assert [t.should_prune() for t in ranks] == [False, False]
            # Rank 1 asks about step 1 before rank 0 reported it: it gets the answer rank 0's report decides.
            ranks[1].report(0.0, 1)
            answer = []
            asking = threading.Thread(target=lambda: answer.append(ranks[1].should_prune()))
            asking.start()
            ranks[0].report(2.0, 1)  # over the threshold: prune
            asking.join(timeout=30)
            assert answer == [True] and ranks[0].should_prune() is True
            ranks[0].set_user_attr("note", {"k": [1, 2]})
            assert ranks[1].user_attrs == {"note": {"k": [1, 2]}} and ranks[1].params == trial.params
            assert set(ranks[1].distributions) == {"x", "c"}
            with pytest.raises(StudyChannelError, match="low"):
                ranks[0].suggest_float("x", 5.0, 1.0)  # Optuna's own error, raised on the rank
        assert trial.storage.get_trial(trial._trial_id).intermediate_values == {0: 0.5, 1: 2.0}
        assert reports == [(trial.number, 0, 0.5), (trial.number, 1, 2.0)]
        with pytest.raises(StudyChannelError, match="not running"):
            ranks[0].report(1.0, 2)  # the trial's gang has ended
        wrong = TrialAddress(*server.address, b"x" * 32, False, trial.number)
        with pytest.raises((StudyChannelError, OSError)):
            RankTrial(_Study(wrong, 0), trial.number).suggest_float("x", 0.0, 1.0)
    finally:
        server.close()


def test_a_trials_channel_that_breaks_is_opened_again_and_no_request_is_lost_or_taken_twice():
    """Rank 0's connection to the study ends just as the study has taken its report, before the
    answer reaches it: the rank opens a new connection, asks again, and gets the answer given, the
    report recorded once; a suggestion asked before the break is the same after it."""
    import socket

    from sparktrain.tune.rank import RankTrial, TrialAddress, _Study
    from sparktrain.tune.server import TrialServer

    study = optuna.create_study()
    trial = study.ask()
    server = TrialServer("127.0.0.1", encrypted=True)
    address = TrialAddress(*server.address, server.secret, True, trial.number)
    reports, cut = [], []

    def on_report(number, step, value):
        reports.append((number, step, value))
        if not cut:  # the study's end of rank 0's connection goes, its answer not yet sent
            mine = ranks[0]._study._channel.sock.getsockname()
            for ch in list(server._connections):
                if ch.sock.getpeername() == mine:
                    cut.append(ch)
                    ch.sock.shutdown(socket.SHUT_RDWR)

    try:
        with server.serve(trial, on_report):
            ranks = [RankTrial(_Study(address, r), trial.number) for r in range(2)]
            first = ranks[0]._study._channel
            x = ranks[0].suggest_float("x", 0.0, 1.0)
            ranks[0].report(0.25, 0)
            assert cut and ranks[0]._study._channel is not first and ranks[0]._study._channel.encrypted
            assert ranks[0].suggest_float("x", 0.0, 1.0) == x == ranks[1].suggest_float("x", 0.0, 1.0)
            ranks[0].report(0.5, 1)
        assert reports == [(trial.number, 0, 0.25), (trial.number, 1, 0.5)]
        assert trial.storage.get_trial(trial._trial_id).intermediate_values == {0: 0.25, 1: 0.5}
    finally:
        server.close()


# -- on Spark ----------------------------------------------------------------------------------------

def test_the_same_suggestions_on_every_rank_trials_at_once_and_queued_params(spark, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service import utils as mlflow_uri

    # MLflow keeps the URI it used in the process; this test's leaves with it (a later test's hand-off reads it).
    monkeypatch.setattr(mlflow_uri, "_tracking_uri", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    study = optuna.create_study(study_name="meeting")
    study.enqueue_trial({"x": 1.5, "kind": "b", "layers": 3})
    out = io.StringIO()
    with mlflow.start_run() as parent:
        sparktrain.tune.optimize(study, functools.partial(objectives.meeting, str(tmp_path)), n_trials=4,
                                 concurrent_trials=2, num_proc=2, stdout=out)
    seen = objectives.read(str(tmp_path))
    assert sorted(seen) == [(n, r) for n in range(4) for r in range(2)]
    for trial in study.trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE, (trial, out.getvalue())
        ranks = [seen[trial.number, r] for r in range(2)]
        # Every rank got the study's one value per name, asked twice or not, and sees it in trial.params.
        for r in ranks:
            assert r["x"] == r["again"] == trial.params["x"]
            assert (r["kind"], r["layers"]) == (trial.params["kind"], trial.params["layers"])
            assert r["params"] == trial.params
        assert trial.value == pytest.approx((trial.params["x"] - 1.0) ** 2 + trial.params["layers"])
        assert trial.user_attrs == {"seen_by_rank_0": trial.params["x"], "seen_by_rank_1": trial.params["x"]}
    assert study.trials[0].params == {"x": 1.5, "kind": "b", "layers": 3}  # the queued trial ran with its params
    # Trials 0 and 1 ran at once: neither could end before a rank of the other had started. (A trial
    # runs from its first rank's start to its last rank's end: its ranks start a moment apart.)
    def span(number):
        return min(seen[number, r]["started"] for r in range(2)), max(seen[number, r]["ended"] for r in range(2))

    (a0, a1), (b0, b1) = span(0), span(1)
    assert a0 < b1 and b0 < a1, (span(0), span(1))
    lines = out.getvalue().splitlines()
    assert sum("sparktrain: tune: trial" in line and "started on 2 rank(s)" in line for line in lines) == 4
    assert sum(" complete, value " in line for line in lines) == 4, out.getvalue()
    # The study is the driver's MLflow run; each trial one nested run with its params, value and state.
    client = mlflow.MlflowClient()
    nested = client.search_runs([parent.info.experiment_id],
                                f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(nested) == 4
    by_trial = {int(r.data.tags["optuna.trial"]): r for r in nested}
    for trial in study.trials:
        run = by_trial[trial.number]
        assert run.info.status == "FINISHED" and run.data.tags["optuna.state"] == "COMPLETE"
        assert float(run.data.params["x"]) == pytest.approx(trial.params["x"])
        assert run.data.metrics["value"] == pytest.approx(trial.value)


def test_a_pruned_gang_stops_early_and_a_failed_trial_lets_the_study_go_on(spark, tmp_path):
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    for params in ({"x": 0.0, "fail": False}, {"x": 0.1, "fail": False}, {"x": 4.0, "fail": False},
                   {"x": 0.2, "fail": True}, {"x": 0.05, "fail": False}):
        study.enqueue_trial(params)
    out, told = io.StringIO(), []
    sparktrain.tune.optimize(study, functools.partial(objectives.steps, str(tmp_path)), n_trials=5,
                             concurrent_trials=1, num_proc=2, stdout=out,
                             callbacks=[lambda study, trial: told.append((trial.number, trial.state.name))])
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "COMPLETE", "PRUNED", "FAIL", "COMPLETE"], out.getvalue()
    # Optuna's callbacks heard every trial's end, the failed one too (caught: the study went on).
    assert told == list(enumerate(states))
    seen = objectives.read(str(tmp_path))
    # The pruned gang stopped at the first step past the warm-up, on both ranks (one answer per step).
    assert seen[2, 0]["last_step"] == seen[2, 1]["last_step"] == 1
    assert seen[0, 0]["last_step"] == seen[0, 1]["last_step"] == 7
    # What the study recorded is rank 0's report (rank 1 reported 1000 more).
    assert study.trials[0].intermediate_values == {s: pytest.approx(1.0 / (s + 1)) for s in range(8)}
    assert sorted(study.trials[2].intermediate_values) == [0, 1]
    failed = study.trials[3]
    assert "rank 1 of trial 3 fails on purpose" in failed.user_attrs[sparktrain.tune.ERROR_ATTR]
    assert "trial 3 failed" in out.getvalue() and "trial 2 pruned" in out.getvalue()


def test_a_multi_objective_study_takes_rank_0s_sequence_and_a_callback_stops_it(spark):
    study = optuna.create_study(directions=["minimize", "maximize"])

    def stop_after_two(study, trial):
        if len(study.trials) >= 2:
            study.stop()

    sparktrain.tune.optimize(study, objectives.two_values, n_trials=6, concurrent_trials=1, num_proc=2,
                             callbacks=[stop_after_two], stdout=io.StringIO())
    assert len(study.trials) == 2  # study.stop() in a callback ended the study, as in Study.optimize
    for trial in study.trials:
        assert trial.state.name == "COMPLETE" and trial.values == [trial.params["x"], 1.0 - trial.params["x"]]


def test_gangs_the_cluster_cannot_hold_are_refused_before_any_trial(spark, tmp_path):
    study = optuna.create_study()
    with pytest.raises(InvalidArgumentError) as e:
        sparktrain.tune.optimize(study, functools.partial(objectives.steps, str(tmp_path)), n_trials=2,
                                 concurrent_trials=3, num_proc=2)
    assert "concurrent_trials=3" in str(e.value) and "6 task slots" in str(e.value) and "has 4" in str(e.value)
    with pytest.raises(InvalidArgumentError, match="sets run's args= itself"):
        sparktrain.tune.optimize(study, objectives.steps, n_trials=1, num_proc=2, args=(1,))
    with pytest.raises(InvalidArgumentError, match="passes its other keywords to sparktrain.run"):
        sparktrain.tune.optimize(study, objectives.steps, n_trials=1, num_proc=2, no_such_keyword=1)
    assert study.trials == []


def _start_driver(storage: str, outdir, n_trials: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "tune_objectives.py"), storage, str(outdir),
                             str(n_trials)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _running_ranks(outdir, count: int, proc: subprocess.Popen) -> list[int]:
    """The pids of ``count`` ranks of the driver's trials, once they all recorded themselves."""
    deadline = time.monotonic() + 180
    while len(objectives.read(str(outdir))) < count:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the driver's trials did not start"
        time.sleep(0.1)
    return [r["pid"] for r in objectives.read(str(outdir)).values()]


@pytest.mark.slow  # a driver of its own (a JVM) and two studies: run by hand, bash tests/run slow
def test_a_killed_drivers_study_is_finished_by_a_second_driver(spark, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = _start_driver(storage, tmp_path, 4)
    try:
        pids = _running_ranks(tmp_path, 4, first)  # two trials of two ranks, blocked
        first.send_signal(signal.SIGKILL)           # our own child: Popen holds it until we wait
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert wait_pids_gone(pids, timeout=60) == []   # no rank of the dead driver lives on
    stored = optuna.storages.RDBStorage(storage, heartbeat_interval=1, grace_period=3,
                                        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
    study = optuna.load_study(study_name="killed", storage=stored)
    assert sorted(t.state.name for t in study.trials) == ["RUNNING", "RUNNING"]
    (tmp_path / "release").touch()
    # Optuna fails a trial whose heartbeat is older than the grace period; wait until both are.
    deadline = time.monotonic() + 30
    while len(stored._get_stale_trial_ids(study._study_id)) < 2:
        assert time.monotonic() < deadline, "the dead driver's trials never went stale"
        time.sleep(0.2)
    sparktrain.tune.optimize(study, functools.partial(objectives.blocked, str(tmp_path)), n_trials=2,
                             concurrent_trials=2, num_proc=2)
    trials = study.trials
    assert [t.state.name for t in trials[:2]] == ["FAIL", "FAIL"]
    assert "RUNNING" not in {t.state.name for t in trials}
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2
    # Optuna's retry callback queued each failed trial again, with its params (a copy this call did not
    # reach waits for the next one).
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback
    copies = {retry.retried_trial_number(t): t for t in trials[2:] if retry.retried_trial_number(t) is not None}
    assert sorted(copies) == [0, 1]
    assert {copies[n].state.name for n in copies} <= {"COMPLETE", "WAITING"}
    assert copies[0].state.name == "COMPLETE" or copies[1].state.name == "COMPLETE"


@pytest.mark.slow  # a driver of its own (a JVM): run by hand, bash tests/run slow
def test_an_interrupt_cancels_every_running_gang(spark, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    driver = _start_driver(storage, tmp_path, 4)
    try:
        pids = _running_ranks(tmp_path, 4, driver)
        interrupted = time.monotonic()
        driver.send_signal(signal.SIGINT)
        output, _ = driver.communicate(timeout=90)
        took = time.monotonic() - interrupted
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode != 0 and "KeyboardInterrupt" in output, output[-3000:]
    assert wait_pids_gone(pids, timeout=30) == []
    study = optuna.load_study(study_name="killed", storage=storage)
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"], output[-3000:]
    print(f"an interrupted study of 2 running gangs ended in {took:.1f} s")


@pytest.mark.timeout(240)
def test_the_dashboard_shows_the_study_in_chromium(spark, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed here (.ci/run installs it: apt-get install chromium)")
    pytest.importorskip("optuna_dashboard")
    from storage_servers import free_port
    from test_notebooks import CHROMIUM_FLAGS, page_text

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="digits-cnn")
    study.enqueue_trial({"x": 0.5, "fail": False})
    study.enqueue_trial({"x": 1.0, "fail": True})
    out = io.StringIO()
    sparktrain.tune.optimize(study, functools.partial(objectives.steps, str(tmp_path)), n_trials=2,
                             concurrent_trials=2, num_proc=2, stdout=out)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL"], out.getvalue()
    port = free_port("127.0.0.1")
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "optuna-dashboard"), storage, "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "optuna-dashboard did not answer"
                time.sleep(0.2)  # no event for "the server answers"; bounded poll
        page = f"http://127.0.0.1:{port}/dashboard/studies/{study._study_id}"
        flags = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                 "--virtual-time-budget=15000"]
        dom = subprocess.run([*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        text = page_text(dom)
        assert "digits-cnn" in text, text[:2000]
        trials = subprocess.run([*flags, "--dump-dom", page + "/trials?numbers=1"], capture_output=True, text=True,
                                timeout=120, check=True).stdout
        assert sparktrain.tune.ERROR_ATTR in page_text(trials), page_text(trials)[:3000]
        shots = os.environ.get("SPARKTRAIN_TEST_ARTIFACTS") or str(tmp_path)
        os.makedirs(shots, exist_ok=True)
        shot = os.path.join(shots, "tune-dashboard.png")
        subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1400,1000", page], capture_output=True,
                       timeout=120, check=True)
        assert os.path.getsize(shot) > 10_000
    finally:
        server.terminate()
        server.wait(timeout=30)
