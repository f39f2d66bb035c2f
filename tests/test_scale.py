"""Many ranks against the real driver: simulated ranks (simranks.py) on the real protocol and
sockets, the real ``Attempt``, ``DriverServer`` and supervision core; and what a cell shows of
many ranks' lines (``driver.show.outputlimit``)."""
from __future__ import annotations

import io
import os
import re
import threading

import pytest

from simranks import SimJob
from sparktrain.driver.supervise.attempt import Attempt, RunInfo
from sparktrain.driver.show.display import Display
from sparktrain.driver.show.outputlimit import BURST, OutputLimit
from sparktrain.errors import RankFailedError
from sparktrain.seam.spec import TaskSpec

pytestmark = pytest.mark.timeout(120)


#: This test process's threads before the test: an earlier test's may end meanwhile, so only the
#: threads started since count.
_earlier: set = set()


def _threads_fds() -> tuple[int, int]:
    return len(set(threading.enumerate()) - _earlier), len(os.listdir("/proc/self/fd"))


def _run_and_fail(n: int) -> dict:
    """``n`` simulated ranks check in, then rank ``n // 2`` fails: what the driver held meanwhile,
    and which ranks were told to stop."""
    spec = TaskSpec(run_id=f"scale{n}", size=n, payload=b"", secret=b"", driver_address=("127.0.0.1", 0),
                    use_gpu=False, output_ranks=None, max_result_bytes=0, start_timeout=60.0, grace_period=2.0,
                    user_env={}, heartbeat_timeout=8.0, encrypted=True)
    seen: dict = {}
    jobs: list[SimJob] = []

    def make_job(spec, on_done):
        job = SimJob(spec, on_done, processes=2, per_host=8)
        jobs.append(job)
        return job

    out = io.StringIO()
    attempt = Attempt(RunInfo(spec.run_id, "sim_train", out, out, False, None, verbose=0), spec, 1, make_job,
                      "127.0.0.1")
    real_step = attempt._step

    def step(event=None):
        real_step(event)
        if "threads" not in seen and len(attempt.hosts) == n:  # every rank checked in: the driver's load now
            seen["threads"], seen["fds"] = _threads_fds()
            jobs[0].tell({"cmd": "print", "lines": 2})
            jobs[0].tell({"cmd": "fail", "rank": n // 2})

    attempt._step = step
    try:
        with pytest.raises(RankFailedError) as err:
            attempt.supervise()
    finally:
        for job in jobs:
            job.kill()
    seen["error"] = err.value
    seen["aborted"] = set(jobs[0].aborted())
    seen["lines"] = out.getvalue().count("\n")
    return seen


def test_every_rank_checks_in_a_failure_stops_every_rank_and_the_driver_holds_no_thread_per_rank():
    _earlier.update(threading.enumerate())
    before = _threads_fds()
    small = _run_and_fail(16)
    large = _run_and_fail(128)
    for n, seen in ((16, small), (128, large)):
        assert list(seen["error"].failures) == [n // 2]
        assert "simulated failure" in str(seen["error"])
        assert seen["aborted"] == set(range(n)) - {n // 2}  # every other rank was told to stop
        assert seen["lines"] >= 2 * (n - 1)  # every line was written (the file gets them all)
    # One thread serves every connection: none more at 128 ranks than at 16; one socket per rank.
    assert large["threads"] == small["threads"], (small, large)
    assert large["fds"] - small["fds"] <= 128 - 16 + 4, (before, small, large)
    assert _threads_fds()[0] == before[0]  # nothing left running


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_shows_rank_0_and_a_few_lines_of_the_others_and_says_what_it_held_back():
    out = Tty()
    d = Display(out, out, timestamps=False, verbose=0, size=1024)
    for step in range(3):
        for rank in range(1024):
            d.write(rank, "stdout", f"step {step}", 0.0)
    d.finish("done")
    lines = out.getvalue().replace("\r\x1b[K", "").splitlines()
    assert [ln for ln in lines if ln.startswith("[0]")] == [f"[0]<stdout>:step {s}" for s in range(3)]
    others = [ln for ln in lines if re.match(r"\[[1-9]\d*\]", ln)]
    assert BURST <= len(others) < BURST + 10  # a burst, then the rate (of a loop that takes milliseconds)
    notes = [ln for ln in lines if ln.startswith("sparktrain: held back")]
    assert len(notes) == 1, lines[-3:]
    held = int(re.search(r"held back ([\d,]+) line", notes[0]).group(1).replace(",", ""))
    assert held + len(others) == 3 * 1023
    assert "of 1,023 rank(s)" in notes[0] and "pass log_url=" in notes[0]


def test_a_terminal_shows_every_line_of_a_run_of_16_ranks():
    out = Tty()
    d = Display(out, out, timestamps=False, verbose=0, size=16)
    for step in range(10):
        for rank in range(16):
            d.write(rank, "stdout", f"step {step}", 0.0)
    d.finish("done")
    assert out.getvalue().count("\n") == 160 and "held back" not in out.getvalue()


def test_a_file_gets_every_line_of_every_rank():
    out = io.StringIO()
    d = Display(out, out, timestamps=False, verbose=0, size=512)
    for rank in range(512):
        d.write(rank, "stderr", "a warning", 0.0)
    d.finish("done")
    assert out.getvalue().count("\n") == 512 and "held back" not in out.getvalue()


def test_the_output_limit_refills_at_its_rate_and_notes_at_its_pace():
    limit = OutputLimit(frozenset({0, 3}), rate=2.0, burst=2)
    assert all(limit.admit(0, 0.0) for _ in range(100))  # a shown rank is never held back
    assert [limit.admit(1, 0.0) for _ in range(3)] == [True, True, False]
    assert limit.note(5.0, kept=True) is None  # not yet: once every NOTE_SECONDS
    assert limit.admit(2, 0.5) and not limit.admit(2, 0.5)  # half a second at 2 lines/s: one more
    note = limit.note(10.0, kept=True)
    assert note.startswith("sparktrain: held back 2 line(s) of 2 rank(s) in 10 s") and "every line is in log_url" in note
    assert "rank(s) 0, 3" in note and limit.note(30.0, kept=True, force=True) is None  # counted afresh


def test_a_growing_map_keeps_every_version_as_it_was():
    from sparktrain.driver.supervise.growing import Growing

    empty = Growing()
    one = empty.plus(1, "a")
    two = one.plus(2, "b")
    branch = one.plus(3, "c")  # not the newest of its log: a copy
    changed = two.plus(1, "z")  # a key it has: a copy
    assert dict(empty) == {} and dict(one) == {1: "a"} and dict(two) == {1: "a", 2: "b"}
    assert dict(branch) == {1: "a", 3: "c"} and dict(changed) == {1: "z", 2: "b"}
    assert 2 not in one and 3 not in two and list(two) == [1, 2] and len(branch) == 2
    with pytest.raises(KeyError):
        one[2]
