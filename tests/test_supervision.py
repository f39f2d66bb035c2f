"""The supervision core (``sparktrain.driver.supervise.supervision``) and the size policies
(``policies``) as table tests, and the run's loop (``attempts.supervise``) driven by a launch of fake
jobs (:class:`ScriptedLaunch`): no Spark, no rank process. The end-to-end fault tests
(tests/test_faults.py, test_retries.py, test_run_spark.py, test_hvd_elastic.py) prove the real thing.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest

import types

from sparktrain.driver.supervise import policies
from sparktrain.driver.supervise import supervision as core
from sparktrain.driver.supervise.attempts import supervise
from sparktrain.seam.protocol import RankError
from sparktrain.errors import (RankFailedError, RankFailure, ResultTooLargeError, RunCancelledError,
                               RunTimeoutError, SparkTrainError, StartTimeoutError)
from sparktrain.seam.spec import TaskSpec

pytestmark = pytest.mark.timeout(60)

LIMITS = core.Limits(size=3, started=100.0, start_timeout=10.0, deadline=200.0, run="run r of f", timeout=100.0)


def failure(rank: int, retryable: bool = True, message: str = "boom") -> RankFailure:
    return RankFailure(rank=rank, host="h", local_rank=rank, exc_type="builtins.ValueError", message=message,
                       retryable=retryable)


def drive(events, state=None, limits=LIMITS):
    """Feed ``(now, event)`` pairs to the core; return the last state and every action, in order."""
    state = state if state is not None else core.Starting()
    actions = []
    for now, event in events:
        state, done = core.step(state, event, now, limits)
        actions += done
    return state, actions


HELLOS = [(101.0, core.CheckedIn(0, "a", 2)), (101.5, core.CheckedIn(1, "a", 0)), (102.0, core.CheckedIn(2, "b", 1))]

CASES = {
    "every rank checks in": (
        HELLOS, core.Running, [core.Started(2.0)], None),
    "the start timeout names the missing ranks": (
        [HELLOS[0], (110.5, None)], core.Stopping, [core.Stop("start_timeout expired")],
        (StartTimeoutError, "waiting for rank(s) [1, 2] to start (1 of 3 checked in)")),
    "the start timeout does not apply once every rank is in": (
        HELLOS + [(150.0, None)], core.Running, [core.Started(2.0)], None),
    "a rank's failure stops the others": (
        HELLOS + [(120.0, core.RankFailed(failure(1)))], core.Stopping,
        [core.Started(2.0), core.Stop("rank 1 failed")], None),
    "the run's deadline stops it": (
        HELLOS + [(200.5, None)], core.Stopping, [core.Started(2.0), core.Stop("timeout expired")],
        (RunTimeoutError, "run r of f took longer than timeout=100 s")),
    "the job ending under running ranks stops them": (
        HELLOS + [(130.0, core.JobEnded(failed=True))], core.Ended,
        [core.Started(2.0), core.Stop("the run's Spark job ended")], None),
    "the job ending while starting stops the ranks that came": (
        [HELLOS[0], (103.0, core.JobEnded(failed=True))], core.Ended, [core.Stop("the run's Spark job ended")],
        None),
    "a job that succeeds ends the attempt quietly": (
        HELLOS + [(130.0, core.JobEnded(failed=False))], core.Ended, [core.Started(2.0)], None),
    "failures while stopping are kept, and stop nothing again": (
        HELLOS + [(120.0, core.RankFailed(failure(1))), (120.1, core.RankFailed(failure(0))),
                  (200.5, None), (121.0, core.JobEnded(failed=True))],
        core.Ended, [core.Started(2.0), core.Stop("rank 1 failed")], None),
    "a failure report after the job ended still counts": (
        HELLOS + [(130.0, core.JobEnded(failed=False)), (130.1, core.RankFailed(failure(2)))], core.Ended,
        [core.Started(2.0)], None),
    "a start timeout keeps its error through the job's end": (
        [(110.5, None), (111.0, core.JobEnded(failed=True))], core.Ended, [core.Stop("start_timeout expired")],
        (StartTimeoutError, "rank(s) [0, 1, 2]")),
}


@pytest.mark.parametrize("events, kind, actions, error", CASES.values(), ids=CASES.keys())
def test_the_core_steps(events, kind, actions, error):
    state, done = drive(events)
    assert type(state) is kind
    assert done == actions
    got = getattr(state, "error", None)
    if error is None:
        assert got is None
    else:
        assert isinstance(got, error[0]) and error[1] in str(got), got


def test_the_core_keeps_each_ranks_first_failure_and_where_each_partition_checked_in():
    state, _ = drive(HELLOS + [(120.0, core.RankFailed(failure(1, message="first"))),
                               (120.1, core.RankFailed(failure(1, message="second")))])
    assert state.seen.failures[1].message == "first"
    assert dict(state.seen.partitions) == {2: 0, 0: 1, 1: 2}
    assert dict(state.seen.hosts) == {0: "a", 1: "a", 2: "b"}


RETRIES = {
    "a retryable failure with attempts left": (SparkTrainError("x"), 1, 3, False, True),
    "the last attempt": (SparkTrainError("x"), 3, 3, False, False),
    "the run's time is spent": (SparkTrainError("x"), 1, 3, True, False),
    "a cancellation": (RunCancelledError("x"), 1, 3, False, False),
    "a timeout": (RunTimeoutError("x"), 1, 3, False, False),
    "a result too large": (ResultTooLargeError("x"), 1, 3, False, False),
    "a rank's failure that would recur": (RankFailedError([failure(0, retryable=False)]), 1, 3, False, False),
    "a rank's failure": (RankFailedError([failure(0)]), 1, 3, False, True),
}


@pytest.mark.parametrize("error, number, most, out_of_time, again", RETRIES.values(), ids=RETRIES.keys())
def test_the_retry_policy(error, number, most, out_of_time, again):
    assert policies.retry(error, number, most, out_of_time) is again


# -- an attempt's shell, driven by fake jobs --------------------------------------------------------

class FakeJob:
    """A job of the Job protocol whose end the test scripts: it fails with ``error`` or returns
    ``result``; with ``hang``, it runs until cancelled."""

    def __init__(self, on_done, error=None, result=None, hang=False):
        self._on_done, self._error, self._result, self._hang = on_done, error, result, hang
        self._done = threading.Event()
        self.error = None
        self.cancelled = 0

    def start(self):
        if not self._hang:
            self._finish(self._error)

    def _finish(self, error):
        self.error = error
        self._done.set()
        self._on_done()

    def done(self):
        return self._done.is_set()

    def wait(self, timeout):
        return self._done.wait(timeout)

    def cancel(self):
        self.cancelled += 1
        if not self._done.is_set():
            self._finish(Exception("Job 3 cancelled part of cancelled job group sparktrain-r"))

    def result_bytes(self):
        return self._result


def spec(channel: bool, start_timeout: float = 600.0) -> TaskSpec:
    return TaskSpec(run_id="r", size=2, payload=b"", secret=b"", driver_address=("127.0.0.1", 0) if channel else None,
                    use_gpu=False, output_ranks=None, max_result_bytes=0, start_timeout=start_timeout,
                    grace_period=0.1, user_env={})


class ScriptedLaunch:
    """A ``Launch`` (``sparktrain.driver.launch.prepare``) whose jobs are ``make``'s and whose slots
    are scripted: ``slots``, what each wait for slots finds, in turn (the last again once they run
    out). Keeps every fit ``(want, wait)`` and every resize marker ``(attempt, why)``; ``on_mark``
    is called with each marker (a test's job ends as its ranks would)."""

    def __init__(self, make, run_spec: TaskSpec, timeout=None, slots=(2,), on_mark=None):
        args = types.SimpleNamespace(run_id="r", fn_name="f", stdout=None, stderr=None, timestamps=False,
                                     timeout=timeout, verbose=0, local=False)
        self.cfg = types.SimpleNamespace(args=args, driver_host="127.0.0.1", capacity_wait=0.0,
                                         settings=types.SimpleNamespace(lease_timeout=60.0))
        self.name, self.home, self.local_master = None, self, True
        self.make, self.run_spec, self._slots, self.on_mark = make, run_spec, list(slots), on_mark
        self.fits, self.waits, self.marks, self.most = [], [], [], None

    def spec(self, most):
        self.most = most
        return self.run_spec

    def stage_input(self, size):
        return None

    def job(self, spec, on_done):
        return self.make(spec, on_done)

    def fit(self, want, wait):
        self.fits.append((want, wait))
        return want if want is not None else self.slots()

    def slots(self):
        return self._slots[0] if len(self._slots) == 1 else self._slots.pop(0)

    def wait_for_slots(self, low, wait):
        self.waits.append((low, wait))
        return self.slots()

    def leaving(self):
        return []

    def mark_resize(self, attempt, why):
        self.marks.append((attempt, why, threading.current_thread().name))
        if self.on_mark is not None:
            self.on_mark()

    def last_commit(self):
        return None


def jobs_of(script):
    """A job factory that makes one FakeJob per attempt, as ``script`` says, and keeps them."""
    made = []

    def make(spec, on_done):
        made.append(FakeJob(on_done, **script[len(made)]))
        made[-1].spec = spec
        return made[-1]

    return make, made


def spark_error(rank: int, message: str, retryable: bool = True) -> Exception:
    """A task failure as Spark reports it: the rank's RankError text inside Spark's own."""
    return Exception(f"Job aborted due to stage failure: Task {rank} failed: {RankError(failure(rank, retryable, message))}")


def test_a_failed_attempt_is_retried_and_every_attempt_is_counted_in_the_error():
    make, made = jobs_of([{"error": spark_error(1, f"attempt {n} failed")} for n in (1, 2, 3)])
    with pytest.raises(RankFailedError) as e:
        supervise(ScriptedLaunch(make, spec(channel=False)), policies.Fixed(2, 3))
    assert len(made) == 3
    text = str(e.value)
    assert e.value.attempts == 3 and text.startswith("attempt 3 of 3: ")
    assert "Earlier attempts:\n  attempt 1: " in text and "attempt 2 failed" in text


def test_a_retried_attempt_that_succeeds_returns_its_value():
    import cloudpickle

    make, made = jobs_of([{"error": spark_error(0, "transient")}, {"result": cloudpickle.dumps("second")}])
    launch = ScriptedLaunch(make, spec(channel=False))
    assert supervise(launch, policies.Fixed(2, 2, capacity_wait=5.0)) == "second"
    # The first attempt's slots waited for as long as capacity_wait, the retry's as long as a lost executor takes.
    assert len(made) == 2 and launch.fits == [(2, 5.0), (2, policies.RETRY_CAPACITY_WAIT)]


def test_a_fixed_run_of_every_slot_counts_them_once_and_retries_at_that_size():
    import cloudpickle

    make, made = jobs_of([{"error": spark_error(0, "transient")}, {"result": cloudpickle.dumps("second")}])
    launch = ScriptedLaunch(make, spec(channel=False), slots=(3,))
    assert supervise(launch, policies.Fixed(None, 2)) == "second"
    assert launch.fits == [(None, 0.0), (3, policies.RETRY_CAPACITY_WAIT)] and launch.most == 3
    assert [job.spec.size for job in made] == [3, 3]


def test_a_failure_that_would_recur_is_not_retried():
    make, made = jobs_of([{"error": spark_error(0, "too big", retryable=False)}, {}])
    with pytest.raises(RankFailedError):
        supervise(ScriptedLaunch(make, spec(channel=False)), policies.Fixed(2, 3))
    assert len(made) == 1


def test_a_cancelled_job_is_a_cancelled_run_and_not_retried():
    make, made = jobs_of([{"error": Exception("Job 1 cancelled part of cancelled job group sparktrain-r")}, {}])
    with pytest.raises(RunCancelledError, match="run r of f was cancelled"):
        supervise(ScriptedLaunch(make, spec(channel=False)), policies.Fixed(2, 2))
    assert len(made) == 1


def test_a_run_timeout_stops_a_hanging_job_and_is_not_retried():
    make, made = jobs_of([{"hang": True}, {"hang": True}])
    with pytest.raises(RunTimeoutError, match="took longer than timeout=0.3 s"):
        supervise(ScriptedLaunch(make, spec(channel=False), timeout=0.3), policies.Fixed(2, 3))
    assert len(made) == 1 and made[0].cancelled >= 1


def test_a_start_timeout_on_the_channel_names_every_missing_rank_and_cancels_the_job():
    make, made = jobs_of([{"hang": True}])
    with pytest.raises(StartTimeoutError, match=r"rank\(s\) \[0, 1\] to start \(0 of 2 checked in\)"):
        supervise(ScriptedLaunch(make, spec(channel=True, start_timeout=0.3)), policies.Fixed(2, 1))
    assert made[0].cancelled >= 1


def test_a_job_that_ends_in_error_under_ranks_that_said_nothing_names_what_spark_said():
    make, _ = jobs_of([{"error": Exception("Job aborted due to stage failure: ExecutorLostFailure (executor 1 "
                                           "exited caused by one of the running tasks)")}])
    with pytest.raises(SparkTrainError, match="ExecutorLostFailure"):
        supervise(ScriptedLaunch(make, spec(channel=True)), policies.Fixed(2, 1))


# -- an elastic run's restarts and resizes, decided by the core ---------------------------------------

def rank_failed(exc_type: str = "", traceback: str = "", exitcode=None) -> RankFailedError:
    return RankFailedError([RankFailure(rank=1, host="h", local_rank=0, exc_type=exc_type, traceback=traceback,
                                        exitcode=exitcode)])


def elastic(reset_limit=None) -> policies.Elastic:
    return policies.Elastic(low=2, first=4, high=4, reset_limit=reset_limit, timeout=600.0, grow_after=60.0)


INTERRUPTED = rank_failed("sparktrain.tensorflow.HostsUpdatedInterrupt", "Traceback ...")
GROW = policies.Resize(4, "the cluster has slots for 4 rank(s)")
LOST = "rank 1 on host h was lost"

ELASTIC = {
    "a lost rank restarts with the slots there are": (
        rank_failed(exitcode=-9), 1, None, False, None, policies.Retry(None, LOST)),
    "a peer gone from a collective restarts": (
        rank_failed("sparktrain.engine.CollectiveError", "Traceback ..."), 1, None, False, None,
        policies.Retry(None, LOST + " (sparktrain.engine.CollectiveError)")),
    "an executor Spark lost restarts": (
        SparkTrainError("ExecutorLostFailure"), 1, None, False, None,
        policies.Retry(None, "the attempt failed (ExecutorLostFailure)")),
    "the ranks ended the attempt for a resize": (INTERRUPTED, 1, None, False, GROW, policies.Retry(4, GROW.why, True)),
    "train_fn's own exception ends the run": (
        rank_failed("builtins.ValueError", "Traceback ..."), 1, None, False, None, "same"),
    "a resize nobody asked for is train_fn's own": (INTERRUPTED, 1, None, False, None, "same"),
    "a resize asked for, but a rank failed otherwise": (
        rank_failed("builtins.ValueError", "Traceback ..."), 1, None, False, GROW, "same"),
    "the run's time is spent": (rank_failed(exitcode=-9), 1, None, True, None, "same"),
    "a timeout is not a lost rank": (RunTimeoutError("took longer"), 1, None, False, None, "same"),
    "the reset limit allows this restart": (rank_failed(exitcode=-9), 1, 1, False, None, policies.Retry(None, LOST)),
    "the reset limit is spent": (rank_failed(exitcode=-9), 2, 1, False, None, "gave up after reset_limit=1 restart(s)"),
    "the reset limit counts resizes too": (INTERRUPTED, 1, 0, False, GROW, "gave up after reset_limit=0 restart(s)"),
}


@pytest.mark.parametrize("error, number, limit, out_of_time, resize, expected", ELASTIC.values(), ids=ELASTIC.keys())
def test_an_elastic_runs_restarts(error, number, limit, out_of_time, resize, expected):
    decision = elastic(limit).after_failure(error, number, out_of_time, [], resize)
    if isinstance(expected, policies.Retry):
        assert decision == expected
    elif expected == "same":
        assert decision == policies.GiveUp(error)
    else:
        assert isinstance(decision, policies.GiveUp) and expected in str(decision.error)
        assert type(decision.error) is SparkTrainError and str(error) in str(decision.error)


FIXED = {
    "a retryable failure with attempts left": (SparkTrainError("x\nmore"), 1, False, policies.Retry(None, "x")),
    "the first and last attempt gives its own error": (SparkTrainError("x"), 1, True, "same"),
    "a later last attempt counts the earlier ones": (SparkTrainError("x"), 3, False, "attempt 3 of 3"),
}


@pytest.mark.parametrize("error, number, out_of_time, expected", FIXED.values(), ids=FIXED.keys())
def test_a_fixed_runs_restarts(error, number, out_of_time, expected):
    decision = policies.Fixed(3, 3).after_failure(error, number, out_of_time, ["a", "b"])
    if isinstance(expected, policies.Retry):
        assert decision == expected
    elif expected == "same":
        assert decision.error is error
    else:
        assert isinstance(decision, policies.GiveUp) and expected in str(decision.error)
        assert "attempt 1: a; attempt 2: b" in str(decision.error)


def test_the_one_loop_runs_an_elastic_runs_attempts_on_one_id_and_payload():
    """A lost rank, then a resize the ranks ended the attempt for, then success: three attempts of
    one spec, each at the size the slots allowed, with its number, the same run id and payload."""
    import cloudpickle

    interrupted = RankError(RankFailure(rank=0, host="h", local_rank=0, message="grow", traceback="Traceback ...",
                                        exc_type="sparktrain.errors.HostsUpdatedInterrupt"))
    make, made = jobs_of([{"error": spark_error(1, "died")}, {"hang": True}, {"result": cloudpickle.dumps("done")}])
    run_spec = dataclasses.replace(spec(channel=False), size=4, payload=b"pickled once", output_ranks=frozenset({0, 3}))
    # Attempt 2's lookout sees 4 slots and asks for them at once (grow_after=0); its marker ends it as its ranks would.
    launch = ScriptedLaunch(make, run_spec, slots=(4, 2, 4),
                            on_mark=lambda: made[1]._finish(Exception(f"Task 0 failed: {interrupted}")))
    policy = dataclasses.replace(elastic(), grow_after=0.0)
    assert supervise(launch, policy) == "done"
    specs = [job.spec for job in made]
    assert [(s.size, s.attempt, s.max_attempts) for s in specs] == [(4, 1, 0), (2, 2, 0), (4, 3, 0)]
    assert {(s.run_id, s.payload) for s in specs} == {("r", b"pickled once")}
    assert [s.user_env["SPARKTRAIN_ELASTIC_ATTEMPT"] for s in specs] == ["1", "2", "3"]
    assert [s.output_ranks for s in specs] == [frozenset({0, 3}), frozenset({0}), frozenset({0, 3})]
    assert launch.most == 4 and [m[:2] for m in launch.marks] == [(2, "the cluster has slots for 4 rank(s)")]
    # Each attempt waited for at least min_num_proc slots, then launched at the size it counted.
    assert launch.waits == [(2, 600.0)] * 3 and [want for want, _ in launch.fits] == [4, 2, 4]


def test_an_elastic_run_past_its_reset_limit_raises_the_policys_error():
    make, made = jobs_of([{"error": spark_error(1, "died")}, {"error": spark_error(0, "died again")}])
    with pytest.raises(SparkTrainError, match="gave up after reset_limit=1 restart") as e:
        supervise(ScriptedLaunch(make, spec(channel=False), slots=(2,)), elastic(1))
    assert len(made) == 2 and isinstance(e.value.__cause__, RankFailedError)


# (slots, leaving, size, high, since, now) with grow_after=10
RESIZES = {
    "as many slots as ranks: keep watching": ((4, [], 4, 4, None, 100.0), policies.Keep()),
    "more slots, at the most already": ((6, [], 4, 4, None, 100.0), policies.Keep()),
    "more slots appear: the clock starts": ((6, [], 2, 4, None, 100.0), policies.Keep(100.0)),
    "more slots, not for long enough": ((6, [], 2, 4, 95.0, 104.9), policies.Keep(95.0)),
    "more slots for long enough: grow, up to the most": (
        (6, [], 2, 4, 95.0, 105.0), policies.Resize(4, "the cluster has slots for 4 rank(s)")),
    "grow to the slots there are": ((3, [], 2, 4, 90.0, 105.0), policies.Resize(3, "the cluster has slots for 3 rank(s)")),
    "the slots went again: the clock stops": ((2, [], 2, 4, 95.0, 104.0), policies.Keep()),
    "fewer slots, nobody leaving: a loss, for the ranks to report": ((2, [], 4, 4, None, 100.0), policies.Keep()),
    "a host being decommissioned: shrink at once": (
        (2, ["10.0.0.2"], 4, 4, None, 100.0), policies.Resize(2, "host 10.0.0.2 is being decommissioned")),
    "every slot leaving: one rank still": (
        (0, ["a", "b"], 2, 4, None, 100.0), policies.Resize(1, "host a, b is being decommissioned")),
    "leaving while more slots last: the shrink first": (
        (1, ["b"], 2, 4, 50.0, 100.0), policies.Resize(1, "host b is being decommissioned")),
}


@pytest.mark.parametrize("looked, expected", RESIZES.values(), ids=RESIZES.keys())
def test_the_resize_decision(looked, expected):
    assert policies.resize(*looked, grow_after=10.0) == expected


# -- an elastic attempt's look at the slots, on the turns of the attempt's own loop ------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_lookout_looks_once_a_poll_and_leaves_the_marker_before_it_says_resize():
    from sparktrain.driver.supervise import elastic as el

    clock, looked, marked = Clock(), [], []
    slots = iter([2, RuntimeError("py4j reset"), 4, 4, 4])

    def count():
        looked.append(clock.now)
        value = next(slots)
        if isinstance(value, Exception):
            raise value
        return value

    policy = policies.Elastic(low=1, first=2, high=4, reset_limit=None, timeout=600.0, grow_after=10.0)
    lookout = el.Lookout(count, lambda: [], 2, policy, lambda r: marked.append((r, lookout.resize)), clock)
    for now in (100.5, 101.0, 101.5, 102.0, 103.0, 103.5, 112.9, 113.0, 114.0, 120.0):
        clock.now = now
        lookout.look()
    # A poll's time after the start, then after each look; a failed look stops the clock of the more
    # slots (none at 101; from 103, 9.9 s at 112.9, 11 s at 114: grow); none after it decided.
    assert looked == [101.0, 102.0, 103.0, 112.9, 114.0]
    grown = policies.Resize(4, "the cluster has slots for 4 rank(s)")
    assert marked == [(grown, None)] and lookout.resize == grown  # the marker first, then the decision


def test_a_marker_that_cannot_be_written_asks_no_resize():
    from sparktrain.driver.supervise import elastic as el

    clock = Clock()
    policy = policies.Elastic(low=1, first=2, high=4, reset_limit=None, timeout=600.0, grow_after=0.0)

    def mark(resize):
        raise OSError("the store is gone")

    lookout = el.Lookout(lambda: 4, lambda: [], 2, policy, mark, clock)
    clock.now += el.POLL_SECONDS
    lookout.look()
    clock.now += el.POLL_SECONDS
    lookout.look()
    assert lookout.resize is None


def test_the_attempts_own_loop_looks_and_the_next_attempt_has_the_size_it_asked_for():
    """No thread of its own: the attempt's loop looks at the slots, leaves the marker, and the
    resize it decided is what the policy reads when the ranks end the attempt for it."""
    import cloudpickle

    interrupted = RankError(RankFailure(rank=0, host="h", local_rank=0, message="grow", traceback="Traceback ...",
                                        exc_type="sparktrain.errors.HostsUpdatedInterrupt"))
    make, made = jobs_of([{"hang": True}, {"result": cloudpickle.dumps("done")}])
    launch = ScriptedLaunch(make, spec(channel=False), slots=(2, 4),
                            on_mark=lambda: made[0]._finish(Exception(f"Task 0 failed: {interrupted}")))
    policy = policies.Elastic(low=1, first=2, high=4, reset_limit=None, timeout=600.0, grow_after=0.0)
    before = {t.name for t in threading.enumerate()}
    assert supervise(launch, policy) == "done"
    assert launch.marks == [(1, "the cluster has slots for 4 rank(s)", threading.current_thread().name)]
    assert [j.spec.size for j in made] == [2, 4]
    assert "sparktrain-elastic-resize" not in before | {t.name for t in threading.enumerate()}
