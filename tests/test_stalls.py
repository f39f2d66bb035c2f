"""Stall reports (``stall_warning``): when some ranks wait in a native collective for ranks that
have not arrived, the driver names both and shows the late ranks' Python stacks; a run that then
fails carries the report in its error; an interrupted run prints every rank's stack first.

The ranks are plain numpy processes on the native engine (no TensorFlow), in local mode, so
these cost a second or two of rank time each. tests/test_multihost.py has the same report across
simulated hosts, through a Spark standalone cluster."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from helpers import fault_time, rank_processes, read_time, wait_for_file

import sparktrain
from sparktrain.errors import InvalidArgumentError, RankFailedError


def late_rank(outdir, late):
    """Every rank makes one allreduce; then rank ``late`` waits for the file ``go`` in user code
    (the line the report must show) while the others wait in the second allreduce."""
    import time

    import numpy as np

    from sparktrain import engine

    from helpers import mark_time

    comm = engine.from_env()
    comm.allreduce(np.ones(4, np.float32))
    if comm.rank == 0:
        mark_time(outdir, "entered")  # the stall begins: rank 0 waits from here on
    if comm.rank == late:
        while not os.path.exists(os.path.join(outdir, "go")):
            time.sleep(0.05)  # THE LATE LINE
    total = comm.allreduce(np.ones((8, 3), np.float32), op="sum")
    comm.close()
    # As the interpreter shuts down, faulthandler lets go of SIGUSR1; a stack request that comes
    # then (a stall seen just as the rank finished) must not kill the rank.
    import faulthandler
    import signal

    faulthandler.unregister(signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    return float(total.sum())


def _late_line() -> int:
    import inspect

    lines, first = inspect.getsourcelines(late_rank)
    return first + next(i for i, line in enumerate(lines) if "THE LATE LINE" in line)


class _Reports(logging.Handler):
    """The driver's stall reports, as they are logged; the first one lets the late rank go."""

    def __init__(self, go: str | None):
        super().__init__()
        self.go = go
        self.reports: list[str] = []
        self.at: list[float] = []  # when each report arrived (wall clock)
        self.seen = threading.Event()

    def emit(self, record):
        message = record.getMessage()
        if "stall:" in message:
            self.reports.append(message)
            self.at.append(time.time())
            self.seen.set()
            if self.go:
                open(self.go, "w").close()


def _capture(go: str | None) -> _Reports:
    handler = _Reports(go)
    logging.getLogger("sparktrain").addHandler(handler)
    return handler


def one_stall_report(outdir: str, late: int, num_proc: int, stall_warning: int, timeout: float,
                     **run_kwargs) -> tuple[str, float]:
    """Run ``late_rank`` on ``num_proc`` ranks with rank ``late`` late. The first report lets it go:
    the run must go on to every rank's total, with that one report. Returns the report and how
    long after the stall began the driver logged it."""
    reports = _capture(os.path.join(outdir, "go"))
    try:
        total = sparktrain.run(late_rank, args=(outdir, late), num_proc=num_proc, timeout=timeout,
                               env={"SPARKTRAIN_STALL_WARNING": str(stall_warning)}, verbose=0, **run_kwargs)
    finally:
        logging.getLogger("sparktrain").removeHandler(reports)
    assert total == num_proc * 24  # the run went on once the late rank was let go
    assert len(reports.reports) == 1, reports.reports  # one stall, reported once
    return reports.reports[0], reports.at[0] - read_time(outdir, "entered")


@pytest.mark.timeout(120)
def test_a_stall_report_names_the_late_rank_and_its_line_then_the_run_goes_on(tmp_path):
    report, seconds = one_stall_report(str(tmp_path), 2, num_proc=3, stall_warning=2, timeout=100, local_mode=True)
    head = report.splitlines()[0]
    assert re.search(r"stall: ranks 0 \(\S+\), 1 \(\S+\) have waited \d+ s in allreduce #2 \(float32\[8,3\], sum\); "
                     r"rank 2 has not arrived", head), report
    assert "rank 2 (127.0.0.1) is after allreduce #1 (float32[4], average)" in report, report
    assert f'"{__file__}", line {_late_line()} in late_rank' in report, report
    assert "sparktrain/executor/child.py" not in report  # only the user's frames
    fault_time("stall report, stall_warning=2 s (local)", 2 + 10, seconds)


def _late_rank_never_comes(tmp_path, error_type, timeout: float, collective_timeout: float):
    """Run ``late_rank`` on 2 ranks whose rank 1 never arrives, with stall reports every second;
    returns the ``error_type`` the run raised and the reports the driver logged."""
    reports = _capture(None)
    try:
        with pytest.raises(error_type) as info:
            sparktrain.run(late_rank, args=(str(tmp_path), 1), num_proc=2, local_mode=True, timeout=timeout,
                           verbose=0, env={"SPARKTRAIN_STALL_WARNING": "1",
                                           "SPARKTRAIN_COLLECTIVE_TIMEOUT": str(collective_timeout)})
    finally:
        logging.getLogger("sparktrain").removeHandler(reports)
    return info.value, reports


@pytest.mark.timeout(120)
def test_a_collective_timeout_carries_the_stall_report(tmp_path):
    """The late rank never comes: the others' collective times out (5 s), and the error says why."""
    error, reports = _late_rank_never_comes(tmp_path, RankFailedError, timeout=100, collective_timeout=5)
    assert error.root_cause.rank == 0 and "timed out" in error.root_cause.message, error
    assert reports.reports and error.stall == reports.reports[-1].split(": ", 2)[-1], (reports.reports, error.stall)
    text = str(error)
    assert "The last stall report before the failure:" in text
    assert f"line {_late_line()} in late_rank" in text.split("The last stall report")[1]


@pytest.mark.timeout(120)
def test_a_run_timeout_carries_the_stall_report(tmp_path):
    """The late rank never comes, and the run's own timeout (6 s) ends it first: the RunTimeoutError
    says what the late rank was doing."""
    from sparktrain.errors import RunTimeoutError

    error, reports = _late_rank_never_comes(tmp_path, RunTimeoutError, timeout=6, collective_timeout=60)
    text = str(error)
    assert "timeout=6 s" in text and reports.reports, (text, reports.reports)
    assert "The last stall report before the timeout:" in text
    assert f"line {_late_line()} in late_rank" in text.split("The last stall report")[1]


@pytest.mark.timeout(60)
def test_stall_warning_zero_turns_reports_off_and_bad_values_are_refused_before_launch(tmp_path):
    ran = tmp_path / "ran"
    with pytest.raises(InvalidArgumentError, match=r"SPARKTRAIN_STALL_WARNING must be a positive number of seconds, "
                                                    r"got 'soon'; 0 turns it off"):
        sparktrain.run(lambda: ran.touch(), num_proc=2, local_mode=True, env={"SPARKTRAIN_STALL_WARNING": "soon"})
    assert not ran.exists()
    from sparktrain import settings

    assert settings.resolve("stall_warning", environ={"SPARKTRAIN_STALL_WARNING": "0"}) == 0.0
    assert settings.resolve("stall_warning", conf={"spark.sparktrain.stallWarning": "15s"}, environ={}) == 15.0
    assert settings.resolve("stall_warning", environ={}) == 60.0


DRIVER = textwrap.dedent("""
    import os, sys, time
    import sparktrain

    def wait(outdir):
        import numpy as np
        from sparktrain import engine
        comm = engine.from_env()
        open(os.path.join(outdir, f"ready-{comm.rank}"), "w").close()
        if comm.rank == 1:
            while True:
                time.sleep(0.05)  # RANK 1 WAITS HERE
        comm.allreduce(np.ones(3))  # RANK 0 WAITS HERE

    sparktrain.run(wait, args=(sys.argv[1],), num_proc=2, local_mode=True, timeout=100)
""")


@pytest.mark.timeout(120)
def test_an_interrupted_run_prints_every_ranks_stack_then_stops_them(tmp_path):
    """The driver gets SIGINT (a notebook's stop button) while rank 0 waits in a collective and
    rank 1 in user code: it prints both stacks, then stops the ranks; none is left."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        for r in range(2):
            wait_for_file(str(tmp_path / f"ready-{r}"), timeout=60)
        proc.send_signal(signal.SIGINT)  # our own child, not yet reaped: its pid is still its own
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    run_id = re.search(r"launching 2 rank\(s\) of wait, run (\w+)", err).group(1)
    for rank, line in ((0, "RANK 0 WAITS HERE"), (1, "RANK 1 WAITS HERE")):
        number = DRIVER.splitlines().index(next(s for s in DRIVER.splitlines() if line in s)) + 1
        block = err.split(f"was interrupted; rank {rank} (127.0.0.1) was at:")[1]
        assert f'"{script}", line {number} in wait' in block.split("was interrupted")[0], err
    assert err.index("was interrupted; rank 1") < err.index("KeyboardInterrupt")
    assert rank_processes(f"sparktrain-{run_id}-", timeout=30) == []


FLOODED_LOOP = textwrap.dedent("""
    import sys, threading
    from sparktrain.driver.supervise.interrupts import Interrupts
    from sparktrain.driver.supervise.server import DriverServer, Interrupted, Output

    server = DriverServer(b"k" * 32, 1, "127.0.0.1")  # the queue the supervision loop reads
    def pour():  # a rank's output, as fast as it comes
        while True:
            server.events.put(Output(0, "stdout", "x", 0.0))
    threading.Thread(target=pour, daemon=True).start()
    interrupts = Interrupts(lambda: server.events.put(Interrupted()))
    try:
        with interrupts:
            print("ready", flush=True)  # once the handler is in: a SIGINT from now on is the loop's
            while True:  # the loop's turns, as Attempt._supervise makes them
                interrupts.check()
                server.events.get(timeout=0.1)
    except KeyboardInterrupt:
        for _ in range(100):  # what printing the stacks does next: more waits on the same queue
            server.events.get(timeout=0.01)
        print("stopped", flush=True)
""")


@pytest.mark.timeout(120)
def test_an_interrupt_while_events_pour_in_is_taken_between_waits(tmp_path):
    """SIGINT at a random moment of the supervision loop, while a rank's output pours in: the loop
    raises KeyboardInterrupt at its next turn and its queue still works. Raised inside the wait of
    a queue.Queue, the interrupt left the queue's lock held in about a third of such tries here,
    and the driver hung instead of printing the stacks."""
    import random

    script = tmp_path / "loop.py"
    script.write_text(FLOODED_LOOP)
    for attempt in range(12):
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            threading.Event().wait(random.random() * 0.2)  # a random moment of the loop
            proc.send_signal(signal.SIGINT)  # our own child, not yet reaped
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert (proc.returncode, out.strip()) == (0, "stopped"), (attempt, err[-2000:])


def test_a_run_puts_the_sigint_handler_back_and_an_ignored_sigint_stays_ignored():
    def mine(signum, frame):
        raise AssertionError("not during a run")

    before = signal.signal(signal.SIGINT, mine)
    try:
        assert sparktrain.run(lambda: 7, num_proc=1, local_mode=True, verbose=0) == 7
        assert signal.getsignal(signal.SIGINT) is mine
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert sparktrain.run(lambda: 8, num_proc=1, local_mode=True, verbose=0) == 8
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
