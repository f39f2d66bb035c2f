"""The kernel cache's place where HOME is not writable: this user's own 0700 directory under the temp
dir, never one another user made or could write to. In a subprocess whose HOME is a path no one
can create (under a file), with its own TMPDIR."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

CODE = """
from sparktrain.engine import kernel_cache
try:
    print("DIR", kernel_cache.cache_dir({}))
except OSError as e:
    print("ERROR", e)
"""


def _cache_dir(tmp_path) -> str:
    (tmp_path / "file").write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(tmp_path / "file" / "home"), "TMPDIR": str(tmp)}
    env.pop("SPARKTRAIN_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_without_a_writable_home_the_cache_is_this_users_own_0700_dir_under_the_temp_dir(tmp_path):
    mine = tmp_path / "tmp" / f"sparktrain-cache-{os.geteuid()}"
    assert _cache_dir(tmp_path) == f"DIR {mine}"
    assert (mine.stat().st_mode & 0o777) == 0o700 and mine.stat().st_uid == os.geteuid()
    mine.chmod(0o777)  # as an older sparktrain left it, with the umask's mode: made private again
    assert _cache_dir(tmp_path) == f"DIR {mine}" and (mine.stat().st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_temp_cache_dir_of_another_users_or_a_link_is_refused(tmp_path):
    mine = tmp_path / "tmp" / f"sparktrain-cache-{os.geteuid()}"
    mine.parent.mkdir()
    mine.mkdir(0o777)
    os.chown(mine, 54321, 54321)  # made by someone else, who could plant a library there
    out = _cache_dir(tmp_path)
    assert out.startswith("ERROR no writable cache directory") and str(mine) in out, out
    mine.rmdir()
    (tmp_path / "elsewhere").mkdir()
    mine.symlink_to(tmp_path / "elsewhere")
    out = _cache_dir(tmp_path)
    assert out.startswith("ERROR") and os.listdir(tmp_path / "elsewhere") == [], out
