"""The docs site builds with warnings as errors, its generated tables follow the code, and the
README stays an entry page."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


@pytest.mark.timeout(300)
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    out = tmp_path / "html"
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(tmp_path / "doctrees"), DOCS, str(out)],
                          capture_output=True, text=True, timeout=280)
    problems = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "\n".join(problems) or proc.stderr[-3000:]
    api = (out / "api.html").read_text()
    for name in ("sparktrain.run", "sparktrain.HorovodRunner", "DistributedOptimizer", "RemoteCheckpoint",
                 "sparktrain.data.dataset"):
        assert name in api, f"{name} is missing from the API reference"
    # A docstring's "name : what it is" line is rendered as a parameter, not as a type.
    assert "url</strong>" in api or "url</span>" in api


def test_generated_tables_list_every_setting_and_contract_variable():
    sys.path.insert(0, os.path.join(DOCS, "_ext"))
    try:
        import contract_tables
    finally:
        sys.path.remove(os.path.join(DOCS, "_ext"))
    from sparktrain import settings
    from sparktrain.seam import worker_env

    table = contract_tables.settings_table()
    for s in settings.SETTINGS.values():
        assert f"`{s.env}`" in table and (s.conf is None or f"`{s.conf}`" in table)
    env = contract_tables.env_table()
    for names, _ in worker_env.CONTRACT:
        for n in names:
            assert f"`{n}`" in env
    # Every variable the contract reserves is documented.
    documented = {n for names, _ in worker_env.CONTRACT for n in names}
    assert worker_env.RESERVED_VARS <= documented, sorted(worker_env.RESERVED_VARS - documented)


def test_the_readme_is_an_entry_page_whose_links_resolve():
    import re

    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 300
    for target in re.findall(r"\]\((?!https?://)([^)#]+)", text):
        assert os.path.exists(os.path.join(ROOT, target)), f"README links to {target}, which does not exist"
