"""`sparktrain run train.py`: a training script on every rank, through the installed command.

On an embedded local Spark, in local mode, and started by the spark-submit that ships in pyspark.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

SPARKTRAIN = os.path.join(os.path.dirname(sys.executable), "sparktrain")

#: The training script: each rank reports what it sees as one JSON line.
TRAIN = textwrap.dedent("""
    import json
    import os
    import sys

    import sparktrain
    from beside import GREETING  # a module next to the script, as `python train.py` would find it

    if "--fail" in sys.argv and sparktrain.rank() == 1:
        raise ValueError("bad shard on rank 1")
    config = json.loads(os.environ["TF_CONFIG"])
    print("REPORT " + json.dumps({
        "rank": sparktrain.rank(), "size": sparktrain.size(), "argv": sys.argv, "name": __name__,
        "greeting": GREETING, "env_rank": os.environ["SPARKTRAIN_RANK"], "world_size": os.environ["WORLD_SIZE"],
        "workers": len(config["cluster"]["worker"]), "task_index": config["task"]["index"],
        "my_var": os.environ.get("MY_VAR"),
    }))
""")


@pytest.fixture
def script(tmp_path):
    (tmp_path / "beside.py").write_text("GREETING = 'hello from beside.py'\n")
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def reports(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\[(\d+)\]<stdout>:REPORT (.*)$", line)
        if m:
            found[int(m.group(1))] = json.loads(m.group(2))
    return found


def sparktrain_cli(*args, cwd, timeout=200) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYSPARK_GATEWAY_PORT", None)
    return subprocess.run([SPARKTRAIN, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def assert_ran(proc, script_path, size: int, argv: list[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = reports(proc.stdout)
    assert sorted(found) == list(range(size)), proc.stdout
    for rank, info in found.items():
        assert (info["rank"], info["size"], info["env_rank"], info["world_size"]) == (rank, size, str(rank), str(size))
        assert (info["workers"], info["task_index"]) == (size, rank)
        assert info["argv"] == [str(script_path), *argv]
        assert info["name"] == "__main__"
        assert info["greeting"] == "hello from beside.py"


def test_run_script_on_spark(script):
    proc = sparktrain_cli("run", "train.py", "--master", "local[2]", "--num-proc", "2", "--env", "MY_VAR=x=1",
                          "--", "--tag", "two words", cwd=script.parent)
    assert_ran(proc, script, 2, ["--tag", "two words"])
    assert {info["my_var"] for info in reports(proc.stdout).values()} == {"x=1"}
    assert re.search(r"^sparktrain run: train.py on Spark [\d.]+, master local\[2\]$", proc.stderr, re.M), proc.stderr


def test_run_script_in_local_mode(script):
    proc = sparktrain_cli("run", str(script), "--local", "--num-proc", "3", "--output-ranks", "0,2", cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(reports(proc.stdout)) == [0, 2]  # rank 1 ran, but its output was not asked for
    assert "Spark" not in proc.stderr  # no JVM: local mode starts processes only


def test_a_failing_rank_fails_the_command_with_its_error(script):
    proc = sparktrain_cli("run", "train.py", "--local", "--num-proc", "2", "--", "--fail", cwd=script.parent)
    assert proc.returncode == 1
    assert re.search(r"^sparktrain run: RankFailedError: 1 rank failed; root cause: rank 1 \(.*\): "
                     r"ValueError: bad shard on rank 1$", proc.stderr, re.M), proc.stderr
    assert 'File "' + str(script) + '", line 10, in <module>' in proc.stderr  # the script's own traceback


def test_ranks_run_the_text_read_on_the_driver_where_the_file_is_missing(tmp_path):
    """Executors that do not share the driver's filesystem get the script's text, run as __main__."""
    code = ("import sys\nfrom sparktrain.cli.script import run_script\n"
            "run_script('/nowhere/jobs/train.py', b'import os, sys\\nprint(sys.argv, __name__, "
            "os.path.basename(__file__))\\n', ['--epochs', '2'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv, name, file = proc.stdout.strip().rsplit(" ", 2)
    assert (name, file) == ("__main__", "train.py")
    # The copy that ran, with the script's arguments.
    assert re.fullmatch(r"\['/\S+/sparktrain-script-\w+/train.py', '--epochs', '2'\]", argv), argv


@pytest.mark.parametrize("args, message", [
    (["run", "missing.py", "--local", "--num-proc", "2"], "script 'missing.py' does not exist"),
    (["run", "broken.py", "--local", "--num-proc", "2"], "script 'broken.py' does not compile: "),
    (["run", "train.py", "--num-proc", "2", "--epochs", "5"],
     ("unrecognized arguments: --epochs 5; put the script's own arguments after --, as in: "
      "sparktrain run train.py --num-proc 3 -- --epochs 5")),
    (["run", "train.py", "--local"], "--local needs --num-proc, the number of processes to start"),
    (["run", "train.py", "--local", "--num-proc", "2", "--master", "local[2]"], "--local runs without Spark"),
    (["run", "train.py", "--num-proc", "-2"],
     ("must be a positive number of ranks, got '-2'; to start that many processes on this machine without Spark "
      "use --local --num-proc 2")),
    (["run", "train.py", "--output-ranks", "first"], "argument --output-ranks: must be 'all' or ranks"),
    (["run", "train.py", "--env", "MY_VAR"], "argument --env: expected KEY=VALUE, got 'MY_VAR'"),
    (["run", "train.py", "--local", "--num-proc", "2", "--env", "RANK=3"],
     "env sets RANK, which sparktrain sets for each rank; remove it from env"),
    (["demo", "--", "x"], "only `sparktrain run` takes arguments after --"),
])
def test_bad_input_is_refused_with_the_value_and_the_fix(script, args, message):
    (script.parent / "broken.py").write_text("def train(:\n")
    proc = sparktrain_cli(*args, cwd=script.parent, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "REPORT" not in proc.stdout


# -- spark-submit ---------------------------------------------------------------------------------

def spark_submit(script, *args) -> subprocess.CompletedProcess:
    import pyspark

    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    entry = subprocess.run([SPARKTRAIN, "submit-file"], capture_output=True, text=True, timeout=60).stdout.strip()
    assert entry.endswith(os.path.join("sparktrain", "__main__.py")) and os.path.isfile(entry), entry
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    return subprocess.run([submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false", entry, "run",
                           "train.py", "--num-proc", "2", *args], capture_output=True, text=True, timeout=200,
                          env=env, cwd=script.parent)


def test_run_under_spark_submit_uses_its_session(script):
    proc = spark_submit(script, "--", "--tag", "submitted")
    assert_ran(proc, script, 2, ["--tag", "submitted"])
    out = proc.stdout + proc.stderr  # spark-submit's Python runner may merge the two
    assert re.search(r"^sparktrain run: train.py on Spark [\d.]+, master local\[2\]$", out, re.M), out
    assert "started an embedded" not in out


def test_a_failing_rank_fails_spark_submit(script):
    proc = spark_submit(script, "--", "--fail")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "sparktrain run: RankFailedError: 1 rank failed; root cause: rank 1" in out
    assert "ValueError: bad shard on rank 1" in out
