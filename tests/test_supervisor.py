"""The rank process dies with its parent and takes its own children with it; its watcher removes
what the rank owns if the task dies, and never signals a process that is not the rank's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import cloudpickle
import pytest

from helpers import rank_processes, wait_for_file, wait_pids_gone
from sparktrain.executor.child import EXIT_NOT_LET_GO
from sparktrain.executor.supervisor import ChildProcess

pytestmark = pytest.mark.timeout(60)


def spawn_and_wait(outdir):
    """A rank that starts a grandchild and then blocks, as a stuck training step would."""
    import json
    import os
    import subprocess
    import sys
    import time

    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    from sparktrain.host.localfiles import write_atomically

    pids = {"child": os.getpid(), "grandchild": grandchild.pid}
    write_atomically(os.path.join(outdir, "pids.json"), json.dumps(pids).encode())  # whole, for the waiter
    time.sleep(300)


def _workdir(tmp_path, fn, *args):
    work = tmp_path / "work"
    work.mkdir()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    (work / "payload.pkl").write_bytes(cloudpickle.dumps((fn, args, {})))
    return str(work)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_rank_process_group_dies_with_its_parent(tmp_path, sig):
    work = _workdir(tmp_path, spawn_and_wait, str(tmp_path))
    parent_code = textwrap.dedent(f"""
        import time
        from sparktrain.executor.supervisor import ChildProcess
        from sparktrain.executor.watcher import Watcher
        watcher = Watcher({work!r})
        child = ChildProcess({work!r}, __import__("os").environ)
        watcher.watch_rank(child.pidfd)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env())
    try:
        wait_for_file(str(tmp_path / "pids.json"), timeout=30)
        pids = json.loads((tmp_path / "pids.json").read_text())
        parent.send_signal(sig)  # like Spark destroying the PySpark worker
        parent.wait(10)
        assert wait_pids_gone([pids["child"], pids["grandchild"]], timeout=5) == []
        assert rank_processes(work) == [] and not os.path.exists(work)  # the watcher removed it, and ended
    finally:
        parent.kill()


def test_stop_terminates_the_whole_group_after_grace(tmp_path):
    work = _workdir(tmp_path, spawn_and_wait, str(tmp_path))
    child = ChildProcess(work, _env())
    wait_for_file(str(tmp_path / "pids.json"), timeout=30)
    pids = json.loads((tmp_path / "pids.json").read_text())
    code = child.stop(grace=2.0)
    child.close()
    assert code == 128 + signal.SIGTERM  # SIGTERM became SystemExit in the rank, so finally blocks ran
    assert wait_pids_gone([pids["child"], pids["grandchild"]], timeout=5) == []
    assert rank_processes(work) == []


def wait_ignoring_sigterm(outdir):
    """A rank that shrugs off SIGTERM once it is up, so only SIGKILL ends it."""
    import os
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(outdir, "up"), "w").close()
    time.sleep(300)


@pytest.mark.parametrize("killer", ["elsewhere", "stop"])
def test_a_rank_killed_elsewhere_reports_its_own_failure_even_when_a_stop_reached_its_task_first(tmp_path, killer):
    from sparktrain.executor.output import RankIO
    from sparktrain.executor.task import _raise_failure
    from sparktrain.seam.spec import TaskSpec

    work = _workdir(tmp_path, wait_ignoring_sigterm, str(tmp_path))
    child = ChildProcess(work, _env())
    wait_for_file(str(tmp_path / "up"), timeout=30)
    state = RankIO(TaskSpec(run_id="r", size=2, payload=b"", secret=b"", driver_address=None, use_gpu=False,
                            output_ranks=None, max_result_bytes=0, start_timeout=60, grace_period=0.2,
                            user_env={}), 1, "h")
    if killer == "elsewhere":  # the OOM killer, or a user: the pidfd proves the process is this child
        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
        state.pump(child)  # until its output closes
    pumped_at = time.time()
    # The driver's stop arrives while the killed process's exit does not show yet.
    state.abort_reason, state.aborted_at = "rank 2 failed", 0.0
    code = child.stop(grace=0.2)
    child.close()
    assert code == -signal.SIGKILL and child.killed_elsewhere == (killer == "elsewhere")
    with pytest.raises(Exception) as e:
        _raise_failure(state, code, work, child.killed_elsewhere)
    if killer == "elsewhere":  # a root cause, with its signal, dated when its process ended, not when reported
        assert (e.value.failure.rank, e.value.failure.exitcode) == (1, -signal.SIGKILL), e.value
        assert e.value.failure.time <= pumped_at
    else:  # killed by its own task after the grace period: stopped because of another rank
        assert str(e.value) == "sparktrain rank 1 was stopped: rank 2 failed"


def report_env(outdir):
    import json
    import os

    with open(os.path.join(outdir, "env.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in ("SPARKTRAIN_RANK", "EARLY", "GONE")}, f)
    return 7


def test_a_held_child_runs_nothing_until_let_go_and_then_takes_the_whole_env(tmp_path):
    work = _workdir(tmp_path, report_env, str(tmp_path))
    child = ChildProcess(work, dict(_env(), EARLY="1", GONE="x"), held=True)
    assert not child.exited(0.5)  # still held, as it should be
    assert not (tmp_path / "env.json").exists()
    env = {k: v for k, v in _env().items() if k != "GONE"}
    assert child.go(dict(env, SPARKTRAIN_RANK="2", EARLY="1")) is True
    out = child.stdout.read(), child.stderr.read()
    assert child.reap(5.0) == 0, out
    child.close()
    assert json.loads((tmp_path / "env.json").read_text()) == {"SPARKTRAIN_RANK": "2", "EARLY": "1", "GONE": None}
    assert rank_processes(work) == []


def test_a_held_child_never_let_go_exits_without_running_anything(tmp_path):
    work = _workdir(tmp_path, report_env, str(tmp_path))
    child = ChildProcess(work, _env(), held=True)
    child.close_pipes()  # the go pipe closes without a go
    assert child.reap(5.0) == EXIT_NOT_LET_GO  # never 0: it did not run and succeed
    child.close()
    assert not (tmp_path / "env.json").exists()
    assert rank_processes(work) == []


def test_go_refuses_a_pipe_closed_behind_its_back_and_never_writes_into_its_successor(tmp_path):
    work = _workdir(tmp_path, report_env, str(tmp_path))
    child = ChildProcess(work, _env(), held=True)
    number = child._go
    other = os.open(str(tmp_path / "other-file"), os.O_WRONLY | os.O_CREAT)
    os.close(number)  # a stray close elsewhere in the task process, then the number is reused
    successor = os.dup2(other, number)
    os.close(other)
    try:
        assert child.go({"SPARKTRAIN_RANK": "0"}) is False
        assert os.fstat(successor).st_size == 0  # nothing written into the other file ...
        os.write(successor, b"x")  # ... and it was not closed either
    finally:
        os.close(successor)
    assert child.reap(5.0) == EXIT_NOT_LET_GO
    child.close()
    assert not (tmp_path / "env.json").exists()
    assert rank_processes(work) == []


def test_a_held_child_dies_with_its_parent(tmp_path):
    work = _workdir(tmp_path, report_env, str(tmp_path))
    parent_code = textwrap.dedent(f"""
        import time
        from sparktrain.executor.supervisor import ChildProcess
        child = ChildProcess({work!r}, __import__("os").environ, held=True)
        print(child.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        assert wait_pids_gone([pid], timeout=5) == []
        assert not (tmp_path / "env.json").exists()
    finally:
        parent.kill()


def test_the_watcher_removes_the_spool_and_workdir_of_a_task_that_dies(tmp_path):
    work = _workdir(tmp_path, spawn_and_wait, str(tmp_path))
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "part-0.arrow").write_bytes(b"rows")
    parent_code = textwrap.dedent(f"""
        import time
        from sparktrain.executor.supervisor import ChildProcess
        from sparktrain.executor.watcher import Watcher
        watcher = Watcher({work!r})
        watcher.own({str(spool)!r})
        child = ChildProcess({work!r}, __import__("os").environ)
        watcher.watch_rank(child.pidfd)
        print(watcher.proc.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        watcher = int(parent.stdout.readline())
        wait_for_file(str(tmp_path / "pids.json"), timeout=30)
        pids = json.loads((tmp_path / "pids.json").read_text())
        parent.kill()
        parent.wait(10)
        assert wait_pids_gone([watcher, pids["child"], pids["grandchild"]], timeout=10) == []
        assert not spool.exists() and not os.path.exists(work)
    finally:
        parent.kill()


def _start_with_pid(pid: int, argv: list[str], attempts: int = 20) -> subprocess.Popen | None:
    """Start ``argv`` as process ``pid``, as a process that took a dead rank's pid would be, or None.

    Root can ask the kernel for the next pid (``ns_last_pid``); other processes on the machine
    may take it first, so this tries a few times."""
    for _ in range(attempts):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(argv, start_new_session=True)  # a group leader: its group id is the old rank's
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_the_watcher_never_signals_a_process_that_took_the_dead_ranks_pid(tmp_path):
    """The rank exits and is reaped; a stranger takes its pid, and leads a group of that id; then
    the task dies. The watcher removes the dead task's directory, and leaves the stranger, and a
    live run's directory, alone."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("choosing a pid needs root (/proc/sys/kernel/ns_last_pid)")
    work = _workdir(tmp_path, report_env, str(tmp_path))
    live_run = tmp_path / "sparktrain-live-run"
    live_run.mkdir()
    parent_code = textwrap.dedent(f"""
        import sys
        from sparktrain.executor.supervisor import ChildProcess
        from sparktrain.executor.watcher import Watcher
        watcher = Watcher({work!r})
        child = ChildProcess({work!r}, __import__("os").environ)
        watcher.watch_rank(child.pidfd)
        child.stdout.read()
        child.reap(10.0)  # exited and reaped: its pid is free for anyone
        print(child.pid, watcher.proc.pid, flush=True)
        sys.stdin.read()  # the task lives until the test kills it
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env(), stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
    stranger = None
    try:
        rank_pid, watcher_pid = map(int, parent.stdout.readline().split())
        stranger = _start_with_pid(rank_pid, ["sleep", "300"])
        if stranger is None:
            pytest.skip(f"could not start a process as pid {rank_pid}: other processes took it first")
        parent.kill()  # the task dies
        parent.wait(10)
        assert wait_pids_gone([watcher_pid], timeout=10) == []  # the watcher did its work, and ended
        assert not os.path.exists(work)  # the dead task's directory went
        assert stranger.poll() is None  # the stranger with the rank's pid, and its group, live on
        assert live_run.exists()
    finally:
        parent.kill()
        if stranger is not None:
            stranger.kill()
            stranger.wait()


def test_a_sweep_removes_only_the_rank_directories_whose_task_is_gone(tmp_path):
    """A whole host dies: no task and no watcher is left to remove what its ranks owned. The next
    rank that starts there sweeps it, judging by the lock its task held, never by a pid; a live
    task's directories, and anything else, stay."""
    from sparktrain.executor.workdirs import OWNER, OwnedDir, sweep

    maker_code = textwrap.dedent(f"""
        import sys
        from sparktrain.executor.workdirs import OwnedDir
        dirs = [OwnedDir("sparktrain-deadrun-r{{}}-".format(r), {str(tmp_path)!r}) for r in (2, 3)]
        dirs.append(OwnedDir("sparktrain-deadrun-r2-data-", {str(tmp_path)!r}))
        for d in dirs:
            open(d.path + "/collective.key", "w").write("secret")
        print(" ".join(d.path for d in dirs), flush=True)
        sys.stdin.read()
    """)
    dead = subprocess.Popen([sys.executable, "-c", maker_code], env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", maker_code.replace("deadrun", "liverun")], env=_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    mine = OwnedDir("sparktrain-thisrun-r0-", str(tmp_path))
    unowned = tmp_path / "sparktrain-oldrun-r1-abc"  # no lock file: not the sweep's to judge
    unowned.mkdir()
    other = tmp_path / "sparktrain-notarank"
    other.mkdir()
    (other / OWNER).write_text("")
    try:
        dead_dirs = dead.stdout.readline().split()
        live_dirs = live.stdout.readline().split()
        assert len(dead_dirs) == len(live_dirs) == 3 and all(os.path.isdir(d) for d in dead_dirs + live_dirs)
        assert sweep([str(tmp_path)]) == []  # both makers live
        dead.kill()  # the task dies, and its watcher with it: nothing removes its directories
        dead.wait(10)
        assert all(os.path.isdir(d) for d in dead_dirs)
        assert sorted(sweep([str(tmp_path), str(tmp_path)])) == sorted(dead_dirs)
        assert not any(os.path.exists(d) for d in dead_dirs)
        assert all(os.path.isdir(d) for d in live_dirs) and os.path.isdir(mine.path)
        assert unowned.is_dir() and other.is_dir()
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(10)
        mine.close()
    assert not os.path.exists(mine.path)
    assert sorted(sweep([str(tmp_path)])) == sorted(live_dirs)  # its maker is gone now too
