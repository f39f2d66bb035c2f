"""A rank's traceback shows the user's lines, even where the user's file does not exist."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

from sparktrain.seam import payload

SHOW = textwrap.dedent("""
    import pickle, sys, traceback
    fn = pickle.loads(open(sys.argv[1], "rb").read())
    try:
        fn()
    except ZeroDivisionError:
        traceback.print_exc()
""")


def test_a_by_value_function_keeps_its_file_and_lines_where_the_file_is_gone(tmp_path):
    import cloudpickle

    src = tmp_path / "cell_17.py"
    src.write_text("def helper():\n    return 1 / 0  # the user's failing line\n\n\ndef train():\n    return helper()\n")
    spec = importlib.util.spec_from_file_location("cell_17", src)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cell_17"] = module
    try:
        spec.loader.exec_module(module)
        cloudpickle.register_pickle_by_value(module)
        data = payload.dumps(module.train)
        cloudpickle.unregister_pickle_by_value(module)
    finally:
        del sys.modules["cell_17"]
    os.remove(src)  # as on an executor, which never had the notebook's cell
    blob = tmp_path / "fn.pkl"
    blob.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", SHOW, str(blob)], capture_output=True, text=True, timeout=60)
    assert f'File "{src}", line 2, in helper' in out.stderr, out.stderr
    assert "return 1 / 0  # the user's failing line" in out.stderr, out.stderr
    assert "<dynamic-code>" not in out.stderr


def test_functions_of_installed_modules_travel_by_reference():
    import pickle

    assert pickle.loads(payload.dumps(os.path.join)) is os.path.join
