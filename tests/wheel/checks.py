"""What the wheel must carry, checked where it is installed: the wheel tier (tests/wheel/run)
installs the built wheel into a fresh venv and runs these there, from a copy of tests/ outside the
checkout. Named so that the suite does not collect them: in an editable install they would fail
by design (sparktrain is imported from the checkout)."""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from importlib import metadata

import pytest

import sparktrain
from sparktrain import engine
from sparktrain.tensorflow import kernels

SITE = os.path.realpath(sysconfig.get_paths()["platlib"])
PACKAGE = os.path.join(SITE, "sparktrain")


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), directory]) == directory


def test_sparktrain_is_the_wheels_install_in_this_venv():
    assert sys.prefix != sys.base_prefix, f"not a venv: {sys.prefix}"
    assert _inside(sparktrain.__file__, SITE), f"sparktrain imported from {sparktrain.__file__}, not from {SITE}"
    dist = metadata.distribution("sparktrain")
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    assert "archive_info" in origin and origin["url"].endswith(".whl"), f"not installed from a wheel: {origin}"
    wheel = dist.read_text("WHEEL")
    tags = [line.split(": ", 1)[1] for line in wheel.splitlines() if line.startswith("Tag: ")]
    assert len(tags) == 1 and tags[0].startswith("py3-none-manylinux_"), wheel
    assert "Root-Is-Purelib: false" in wheel, wheel


def test_the_engine_loads_from_the_wheel_under_its_plain_name():
    assert os.environ.get(engine.LIBRARY_ENV) is None
    path = engine._library_path()
    assert path == os.path.join(PACKAGE, "_collective.so"), path
    assert engine.available(), engine.unavailable_reason()
    assert os.path.realpath(engine.library()._name) == os.path.realpath(path)
    recorded = {str(f) for f in metadata.files("sparktrain")}
    assert "sparktrain/_collective.so" in recorded
    assert not [f for f in recorded if f.endswith(".so") and f != "sparktrain/_collective.so"], recorded


def test_the_tensorflow_kernels_sources_are_in_the_wheel():
    assert kernels._source_dir() == os.path.join(PACKAGE, "_native")
    recorded = {str(f) for f in metadata.files("sparktrain")}
    missing = [name for name in kernels.SOURCES if f"sparktrain/_native/{name}" not in recorded]
    assert missing == [], f"the wheel's RECORD lacks {missing}"


def reduce_and_say_where(outdir: str):
    """A rank: an allreduce on the engine the run hands it, and where its sparktrain came from."""
    import numpy as np

    import sparktrain
    from sparktrain import engine

    comm = engine.from_env()
    try:
        total = comm.allreduce(np.arange(4, dtype=np.float32) * (sparktrain.rank() + 1), "sum")
    finally:
        comm.close()
    with open(os.path.join(outdir, f"rank-{sparktrain.rank()}.json"), "w") as f:
        json.dump({"sum": total.tolist(), "package": sparktrain.__file__, "engine": engine._library_path(),
                   "prefix": sys.prefix}, f)


@pytest.mark.timeout(120)
def test_two_ranks_reduce_on_the_wheels_engine(tmp_path):
    sparktrain.run(reduce_and_say_where, args=(str(tmp_path),), num_proc=-2, verbose=0)
    ranks = {}
    for r in range(2):
        with open(tmp_path / f"rank-{r}.json") as f:
            ranks[r] = json.load(f)
    for r, got in ranks.items():
        assert got["sum"] == [0.0, 3.0, 6.0, 9.0], (r, got)
        assert _inside(got["package"], SITE) and got["engine"] == os.path.join(PACKAGE, "_collective.so"), (r, got)
        assert got["prefix"] == sys.prefix, (r, got)  # the ranks run this venv's Python
