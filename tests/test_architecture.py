"""The layout's rules hold: import-linter's contracts in setup.cfg pass on the package, and fail on
a copy of it with a forbidden import added (so the contracts can fail at all); no room is over 400
lines, no function over 80."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")

pytestmark = pytest.mark.timeout(120)


def lint_imports(cwd: str) -> subprocess.CompletedProcess:
    # PYTHONPATH first: a copy of the package in cwd shadows the installed one.
    env = dict(os.environ, PYTHONPATH=cwd)
    return subprocess.run([LINT_IMPORTS, "--config", os.path.join(cwd, "setup.cfg"), "--no-cache"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=100)


def contracts() -> int:
    """How many contracts setup.cfg holds."""
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        return sum(line.startswith("[importlinter:contract:") for line in f)


def test_the_import_contracts_hold():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Contracts: {contracts()} kept, 0 broken." in proc.stdout, proc.stdout


CIRCLES = "No import circles, at any depth of the package"
LAYERS = "Layers: ml over keras over _jax over _keras over tensorflow over engine"
JAX_NO_TF = "The JAX implementation imports no TensorFlow"
JAX_APART = "JAX stays out of the launch and the TensorFlow path"
PURE = "The seam, the host's facts and the settings import neither side"
STAGES = "The driver's stages: face, run, supervise | launch, show"
FACE = "Clients reach the driver through its face alone"
ASKS = "The supervision imports nothing of the launch stage"


@pytest.mark.parametrize("module, line, broken", [
    # Through the executor, the launch (jobs ships the task) would reach back into the supervision.
    ("executor/task.py", "from ..driver.supervise import attempt",
     ["The executor side never imports the driver side", CIRCLES, STAGES]),
    ("driver/supervise/attempt.py", "from ...executor import supervisor",
     ["The driver side imports the executor side only where jobs ships the task"]),
    # The storage's rank room reads the env contract and the rank's settings (the run's home as a rank
    # finds it), so the seam importing storage would be a circle too.
    ("seam/spec.py", "from ..storage import put_bytes", [PURE, CIRCLES]),
    # The executor and the engine import the host's facts: through them the executor would reach the
    # driver side, and the engine the framework layer (the command line's demo trains with Keras).
    # The driver's launch imports the host's facts too: through them it would reach the run's pipeline;
    # and so does JAX's implementation, which would reach TensorFlow.
    ("host/nics.py", "from ..cli import check", [PURE, CIRCLES, "The executor side never imports the driver side",
                                                 LAYERS, STAGES, ASKS, JAX_NO_TF]),
    # Both sides and the channel import the protocol: its importing a side breaks their contracts too.
    ("seam/protocol.py", "from ..executor import stacks",
     ["The protocol is pure: both sides import it, it imports neither", PURE,
      "The driver side imports the executor side only where jobs ships the task", CIRCLES]),
    # JAX's implementation (sparktrain._jax) imports jax, and the TensorFlow path: a circle and JAX on it.
    ("tensorflow/ops.py", "from .._jax import distributed", [LAYERS, CIRCLES, JAX_APART]),
    ("_jax/collectives.py", "from ..tensorflow import runtime", [JAX_NO_TF]),
    ("_jax/optimizer.py", "import tensorflow", [JAX_NO_TF]),
    ("_keras/backend.py", "from .._jax import backend", [LAYERS, CIRCLES, JAX_APART]),
    # JAX's implementation builds on the engine: through it, it would reach TensorFlow.
    ("engine/topology.py", "from ..tensorflow import runtime", [PURE, LAYERS, CIRCLES, JAX_NO_TF]),
    ("driver/launch/feed.py", "from . import config", [CIRCLES]),
    # The launch and the supervision are apart: the launch never reaches into the supervision.
    ("driver/launch/views.py", "from ..supervise import attempts", [STAGES]),
    # The supervision runs the Launch it is given: asking the launch stage for more climbs back up.
    ("driver/supervise/attempts.py", "from ..launch import views", [STAGES, ASKS]),
    # The clients of the driver reach it through its face only.
    ("tune/study.py", "from ..driver.launch import config", [FACE]),
    ("cli/check.py", "from ..driver.supervise import attempts", [FACE]),
    ("ml/estimator.py", "from ..driver.show import display", [FACE]),
    ("tensorflow/kernels.py", "from . import timeline", [CIRCLES]),
    ("tensorflow/ops.py", "import jax", [JAX_APART]),
    ("executor/rankenv.py", "from .. import jax", [JAX_APART]),
    # ml imports the driver's face (model.py: without_pyspark_warnings), so this is a circle too, and climbs the stages. (ml
    # reaches the JAX side only through the front kerasline names at run time, not by an import.)
    ("driver/run.py", "from ..ml import estimator", ["ML stages and studies build on run; neither side of a run imports them",
                                                     CIRCLES, STAGES]),
    ("tune/rank.py", "from ..driver import interrupts", ["A trial's rank side imports nothing of the driver side"]),
    ("keras/fronts/tf_keras.py", "from . import keras3",
     ["The Keras fronts (Keras 3, tf_keras, Keras 3 on JAX) import none of each other"]),
    ("_keras/optimizer.py", "from ..keras import fronts", [LAYERS, CIRCLES]),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, broken):
    shutil.copytree(os.path.join(ROOT, "sparktrain"), tmp_path / "sparktrain",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(os.path.join(ROOT, "setup.cfg"), tmp_path / "setup.cfg")
    target = tmp_path / "sparktrain" / module
    target.write_text(target.read_text() + f"\n\ndef _forbidden():\n    {line}\n")  # a lazy import counts too
    proc = lint_imports(str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for contract in broken:
        assert f"{contract} BROKEN" in proc.stdout, proc.stdout
    assert f"Contracts: {contracts() - len(broken)} kept, {len(broken)} broken." in proc.stdout, proc.stdout


def test_every_room_is_at_most_400_lines_and_every_function_at_most_80():
    """The house's sizes (docs/architecture.md): a file is one subject, a function one step."""
    import ast
    import pathlib

    over = []
    for path in sorted(pathlib.Path(ROOT, "sparktrain").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400:
            over.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert over == []
