"""The driver's filter of TensorFlow's C++ start-up lines keeps every other line of stderr."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_filtered_stderr_drops_start_up_lines_below_the_level_and_keeps_the_rest():
    code = textwrap.dedent("""
        import os
        from sparktrain import tflog
        with tflog.filtered_stderr(2):
            os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
            os.write(2, b"I0000 00:00:1795556702.796779    4534 port.cc:153] oneDNN custom operations are on.\\n")
            os.write(2, b"I0000 00:00:1795556702.862845    4534 cpu_feature_guard.cc:227] This binary is optimized.\\n")
            os.write(2, b"To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
                        b"with the appropriate compiler flags.\\n")
            os.write(2, b"E0000 00:00:1795556702.1    4534 cuda_executor.cc:1] failed call to cuInit: none\\n")
            os.write(2, b"E0000 00:00:1795556702.1    4534 rpc.cc:1] peer gone\\n")
            os.write(2, b"a user's own line\\n")
        os.write(2, b"after\\n")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["E0000 00:00:1795556702.1    4534 rpc.cc:1] peer gone", "a user's own line",
                                        "after"]


def test_the_level_from_the_environment_and_the_callers_default_when_unset():
    from sparktrain.tflog import level_from_env

    assert level_from_env({}) == 0  # TensorFlow's own default
    assert level_from_env({}, unset=2) == 2  # a caller that quiets TensorFlow unless told otherwise
    assert level_from_env({"TF_CPP_MIN_LOG_LEVEL": "1"}, unset=2) == 1  # the user's setting wins
    assert level_from_env({"TF_CPP_MIN_LOG_LEVEL": "quiet"}, unset=2) == 0  # not a number: as TensorFlow reads it
