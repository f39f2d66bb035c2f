"""``sparktrain check`` reports which engine each executor's CPU collectives run on."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from sparktrain import engine

SPARKTRAIN = os.path.join(os.path.dirname(sys.executable), "sparktrain")

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not engine.available(), reason=str(engine.unavailable_reason()))]


def test_check_names_the_cpu_engine_of_every_executor():
    env = dict(os.environ)
    env.pop("PYSPARK_GATEWAY_PORT", None)
    proc = subprocess.run([SPARKTRAIN, "check", "--master", "local[2]"], capture_output=True, text=True, timeout=200,
                          env=env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert re.search(r"^  engine +driver: native; executors: native on 2 of 2$", out, re.M), out
