"""The oldest TensorFlow and Keras sparktrain runs with: older ones are refused at import, with
the versions found and the fix."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _installed_as(tmp_path, name: str, version: str) -> dict:
    """An environment whose Python finds ``name`` at ``version`` first: its metadata, as pip
    writes it, in a directory ahead of site-packages (the package itself is never imported)."""
    info = tmp_path / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module, name, version, fix", [
    ("sparktrain.keras", "keras", "2.15.0", "tf_keras through sparktrain.tensorflow.strategy()"),
    ("sparktrain.keras", "tensorflow", "2.15.1", "pip install 'tensorflow>=2.16'"),
    ("sparktrain.tensorflow", "tensorflow", "2.13.0", "pip install 'tensorflow>=2.16'"),
])
def test_an_older_release_is_refused_at_import_with_the_version_and_the_fix(tmp_path, module, name, version, fix):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], env=_installed_as(tmp_path, name, version),
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and f"{name} {version} is older than" in last and fix in last, last


def test_the_floors_themselves_pass():
    from sparktrain.seam.versions import FLOORS, below_floor

    assert below_floor(dict(FLOORS)) == []
    assert below_floor({"tensorflow": "2.16.1", "keras": "3.2.1"}) == []  # Databricks 15.4 LTS ML
    assert len(below_floor({"tensorflow": "2.15.0", "keras": "2.15.0"})) == 2
