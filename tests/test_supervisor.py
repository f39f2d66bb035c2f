"""The rank process dies with its parent and takes its own children with it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

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
    with open(os.path.join(outdir, "pids.json"), "w") as f:
        json.dump({"child": os.getpid(), "grandchild": grandchild.pid}, f)
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
        child = ChildProcess({work!r}, __import__("os").environ)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env())
    try:
        wait_for_file(str(tmp_path / "pids.json"), timeout=30)
        pids = json.loads((tmp_path / "pids.json").read_text())
        parent.send_signal(sig)  # like Spark destroying the PySpark worker
        parent.wait(10)
        assert wait_pids_gone([pids["child"], pids["grandchild"]], timeout=5) == []
    finally:
        parent.kill()


def test_stop_terminates_the_whole_group_after_grace(tmp_path):
    work = _workdir(tmp_path, spawn_and_wait, str(tmp_path))
    child = ChildProcess(work, _env())
    wait_for_file(str(tmp_path / "pids.json"), timeout=30)
    pids = json.loads((tmp_path / "pids.json").read_text())
    code = child.stop(grace=2.0)
    child.close_pipes()
    assert code == 128 + signal.SIGTERM  # SIGTERM became SystemExit in the rank, so finally blocks ran
    assert wait_pids_gone([pids["child"], pids["grandchild"]], timeout=5) == []
    shutil.rmtree(work)  # as run_rank does: then the rank's watcher ends too
    assert rank_processes(work) == []


def report_env(outdir):
    import json
    import os

    with open(os.path.join(outdir, "env.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in ("SPARKTRAIN_RANK", "EARLY", "GONE")}, f)
    return 7


def test_a_held_child_runs_nothing_until_let_go_and_then_takes_the_env_changes(tmp_path):
    work = _workdir(tmp_path, report_env, str(tmp_path))
    child = ChildProcess(work, dict(_env(), EARLY="1", GONE="x"), held=True)
    try:
        assert child.wait(0.5) is None
    except subprocess.TimeoutExpired:
        pass  # still held, as it should be
    assert not (tmp_path / "env.json").exists()
    assert child.go({"SPARKTRAIN_RANK": "2", "GONE": None}) is True
    out = child.stdout.read(), child.stderr.read()
    assert child.reap(5.0) == 0, out
    child.close_pipes()
    assert json.loads((tmp_path / "env.json").read_text()) == {"SPARKTRAIN_RANK": "2", "EARLY": "1", "GONE": None}
    shutil.rmtree(work)
    assert rank_processes(work) == []


def test_a_held_child_released_exits_without_running_anything(tmp_path):
    work = _workdir(tmp_path, report_env, str(tmp_path))
    child = ChildProcess(work, _env(), held=True)
    assert child.release(5.0) == EXIT_NOT_LET_GO  # never 0: it did not run and succeed
    assert not (tmp_path / "env.json").exists()
    shutil.rmtree(work)
    assert rank_processes(work) == []


def test_go_refuses_a_pipe_closed_behind_its_back_and_never_writes_into_its_successor(tmp_path):
    work = _workdir(tmp_path, report_env, str(tmp_path))
    child = ChildProcess(work, _env(), held=True)
    number = child._go
    os.close(number)  # a stray close elsewhere in the task process, then the number is reused
    other = os.open(str(tmp_path / "other-file"), os.O_WRONLY | os.O_CREAT)
    successor = os.dup2(other, number)
    os.close(other)
    try:
        assert child.go({"SPARKTRAIN_RANK": "0"}) is False
        assert os.fstat(successor).st_size == 0  # nothing written into the other file ...
        os.write(successor, b"x")  # ... and it was not closed either
    finally:
        os.close(successor)
    assert child.release(5.0) == EXIT_NOT_LET_GO
    assert not (tmp_path / "env.json").exists()
    shutil.rmtree(work)
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


def test_a_held_child_moved_to_another_workdir_runs_there_and_its_watcher_cleans_up_both(tmp_path):
    home = str(tmp_path / "home")
    os.mkdir(home)
    run_dir = _workdir(tmp_path, report_env, str(tmp_path))
    child = ChildProcess(home, _env(), held=True)
    child.move(run_dir)
    assert child.go({"SPARKTRAIN_RANK": "1"}, run_dir) is True
    out = child.stdout.read(), child.stderr.read()
    assert child.reap(5.0) == 0, out
    child.close_pipes()
    assert json.loads((tmp_path / "env.json").read_text())["SPARKTRAIN_RANK"] == "1"  # the payload in run_dir ran
    shutil.rmtree(run_dir)
    shutil.rmtree(home)
    assert rank_processes(home) == []

    # The task dies while its moved rank runs: the watcher removes both directories.
    os.mkdir(home)
    again = tmp_path / "again"
    again.mkdir()
    run_dir = _workdir(again, spawn_and_wait, str(again))
    parent_code = textwrap.dedent(f"""
        import time
        from sparktrain.executor.supervisor import ChildProcess
        child = ChildProcess({home!r}, __import__("os").environ, held=True)
        child.move({run_dir!r})
        assert child.go({{}}, {run_dir!r})
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env())
    try:
        wait_for_file(str(tmp_path / "again" / "pids.json"), timeout=30)
        pids = json.loads((tmp_path / "again" / "pids.json").read_text())
        parent.kill()
        parent.wait(10)
        assert wait_pids_gone([pids["child"], pids["grandchild"]], timeout=5) == []
        assert rank_processes(home) == []
        assert not os.path.exists(home) and not os.path.exists(run_dir)
    finally:
        parent.kill()
