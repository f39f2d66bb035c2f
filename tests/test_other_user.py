"""An executor user that is not root, with a read-only home: a 2-rank ``sparktrain.run`` on local
Spark started as a second Unix user (made here with useradd, removed after) trains through the
native engine and the TensorFlow kernels, compiles them into that user's own 0700 cache under the
temp dir, writes nothing under its home, and leaves nothing else in /tmp, /dev/shm or the process
table. Needs root (to make the user); its Python is this machine's /usr/bin/python3.11 over this
venv's packages, since this venv's interpreter may live where the user cannot read."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from sparktrain import engine

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(420),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]

SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"

SCRIPT = r"""
import json, os, sys
from pyspark.sql import SparkSession
import sparktrain

def train():
    import tensorflow as tf
    import sparktrain.tensorflow as hvd
    from sparktrain.engine import kernel_cache
    hvd.init()
    step = tf.function(lambda: hvd.allreduce(tf.fill([1024], float(hvd.rank() + 1)), op=hvd.Sum))
    total = float(step().numpy()[0])
    return {"kernels": hvd.collective_kernels(), "total": total, "cache": kernel_cache.cache_dir(),
            "home": os.path.expanduser("~"), "uid": os.geteuid()}

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
try:
    out = sparktrain.run(train, num_proc=2, verbose=0, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
finally:
    spark.stop()
print("RESULT " + json.dumps(out), flush=True)
"""


def _owned(root: str, uid: int) -> list[str]:
    """The entries directly under ``root`` that ``uid`` owns."""
    found = []
    for name in os.listdir(root):
        try:
            if os.lstat(os.path.join(root, name)).st_uid == uid:
                found.append(name)
        except FileNotFoundError:
            pass
    return found


def _tree(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


@pytest.fixture
def other_user():
    """A new Unix user whose home is a directory it cannot write; removed afterwards, with its cache."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it makes a second Unix user with useradd and runs Spark as that user")
    missing = [tool for tool in ("useradd", "userdel", "runuser") if shutil.which(tool) is None]
    if missing or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"needs useradd, userdel, runuser and {SYSTEM_PYTHON}; missing: {missing or SYSTEM_PYTHON}")
    base = tempfile.mkdtemp(prefix="sparktrain-otheruser-")
    os.chmod(base, 0o755)
    home = os.path.join(base, "home")
    os.mkdir(home, 0o755)  # root's: read-only to the user
    name = f"sptr{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--home-dir", home, "--shell", "/usr/sbin/nologin",
                    "--user-group", name], check=True, capture_output=True)
    uid = pwd.getpwnam(name).pw_uid
    try:
        yield name, uid, base, home
    finally:
        subprocess.run(["pkill", "-KILL", "-u", str(uid)], capture_output=True)  # only that user's: it is ours
        subprocess.run(["userdel", name], capture_output=True)
        for parent in ("/tmp", "/dev/shm"):  # whatever the user made there (its cache, or a failed run's)
            for entry in _owned(parent, uid):
                path = os.path.join(parent, entry)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
        shutil.rmtree(base, ignore_errors=True)


def test_a_second_user_with_a_read_only_home_trains_and_caches_in_its_own_temp_dir(other_user):
    name, uid, base, home = other_user
    # The user's interpreter: this machine's Python of the same version, over this venv's packages.
    py = os.path.join(base, "py")
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", py], check=True, capture_output=True)
    site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    pth = os.path.join(py, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages",
                       "project.pth")
    with open(pth, "w") as f:
        f.write(f"import site; site.addsitedir({site!r})\n")
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    os.chown(work, uid, uid)
    script = os.path.join(base, "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    os.chmod(script, 0o644)
    tmp = "/tmp"  # the user's temp dir: env -i leaves it no TMPDIR
    before_tmp, before_shm = set(_owned(tmp, uid)), set(_owned("/dev/shm", uid))
    assert not before_tmp and not before_shm  # a new user owns nothing yet
    # The JVMs' own hsperfdata_<user> directory is Java's, not sparktrain's: turned off.
    env = {"HOME": home, "USER": name, "LOGNAME": name, "PATH": os.environ["PATH"], "LANG": "C.UTF-8",
           "JAVA_TOOL_OPTIONS": "-XX:-UsePerfData",
           "PYSPARK_PYTHON": os.path.join(py, "bin", "python"), "TF_CPP_MIN_LOG_LEVEL": "2",
           **{k: os.environ[k] for k in ("JAVA_HOME",) if k in os.environ}}
    proc = subprocess.run(["runuser", "-u", name, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                           os.path.join(py, "bin", "python"), script], cwd=work, capture_output=True, text=True,
                          timeout=360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    cache = os.path.join(tmp, f"sparktrain-cache-{uid}")
    assert result == {"kernels": True, "total": 3.0, "cache": cache, "home": home, "uid": uid}, result
    st = os.lstat(cache)
    assert st.st_uid == uid and (st.st_mode & 0o777) == 0o700, oct(st.st_mode)
    libraries = [n for n in os.listdir(os.path.join(cache, "tf_kernels")) if n.endswith(".so")]
    assert len(libraries) == 1, libraries
    assert _tree(home) == []  # nothing written under the home
    # Nothing else of the user's left in /tmp or /dev/shm, and none of its processes running.
    left = set(_owned(tmp, uid)) - before_tmp
    # TensorFlow's autograph compiles each converted function from a temporary module in /tmp,
    # removed at exit, whose bytecode Python leaves in /tmp/__pycache__: TensorFlow's, named so.
    if "__pycache__" in left:
        pycache = os.path.join(tmp, "__pycache__")
        assert all(n.startswith("__autograph_generated_file") for n in os.listdir(pycache)), os.listdir(pycache)
        left.remove("__pycache__")
    assert left == {f"sparktrain-cache-{uid}"}, left  # Keras's config went to the cache too, not /tmp/.keras
    assert os.path.exists(os.path.join(cache, "keras"))
    assert set(_owned("/dev/shm", uid)) == set()
    # The user's last processes (the driver's JVM) exit as the run's Python does: wait (bounded) for none.
    deadline = time.monotonic() + 60
    while subprocess.run(["pgrep", "-u", str(uid)], capture_output=True).returncode == 0:
        alive = subprocess.run(["ps", "-o", "pid,args", "-u", str(uid)], capture_output=True, text=True).stdout
        assert time.monotonic() < deadline, f"the user's processes outlived the run:\n{alive}"
        time.sleep(0.2)
