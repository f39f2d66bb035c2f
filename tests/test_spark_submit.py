"""A script started by spark-submit (the one shipped in pyspark) uses its session for run()."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

SCRIPT = textwrap.dedent("""
    import sys
    from pyspark.sql import SparkSession
    import sparktrain

    spark = SparkSession.builder.appName("submitted").getOrCreate()

    def train(tag):
        import sparktrain
        print(f"{tag} from rank {sparktrain.rank()} of {sparktrain.size()}")
        return f"{tag}-result"

    result = sparktrain.run(train, args=("submitted",), num_proc=2)
    print("RESULT", result, spark.sparkContext.master, spark.sparkContext.appName)
    if "--fail" in sys.argv:
        sparktrain.run(lambda: 1 / 0, num_proc=2)
""")


def _spark_submit() -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")


def _submit(tmp_path, *args):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    return subprocess.run([_spark_submit(), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                           str(script), *args], capture_output=True, text=True, timeout=200, env=env,
                          cwd=tmp_path)


def test_a_submitted_script_uses_its_session_and_a_failed_run_fails_the_job(tmp_path):
    """One submission: the script's first run succeeds on spark-submit's session, its second fails."""
    proc = _submit(tmp_path, "--fail")
    lines = proc.stdout.splitlines()
    assert "[0]<stdout>:submitted from rank 0 of 2" in lines and "[1]<stdout>:submitted from rank 1 of 2" in lines, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    # The script's own session was used (its master and app name), not an embedded one.
    assert "RESULT submitted-result local[2] submitted" in lines
    assert "started an embedded" not in proc.stderr
    # Then the failed run fails the job: a nonzero exit, the error with the rank's traceback.
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr  # spark-submit's Python runner merges the driver's stderr into stdout
    # Both ranks divide by zero; whichever fails first is the root cause.
    assert re.search(r"sparktrain.errors.RankFailedError: [12] ranks? failed; root cause: rank [01] ", out)
    assert "ZeroDivisionError: division by zero" in out
