"""The driver's filter of TensorFlow's C++ start-up lines keeps every other line of stderr."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_filtered_stderr_drops_start_up_lines_below_the_level_and_keeps_the_rest():
    code = textwrap.dedent("""
        import os
        from sparktrain.host import tflog
        with tflog.filtered_stderr(2):
            os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
            os.write(2, b"I0000 00:00:1795556702.796779    4534 port.cc:153] oneDNN custom operations are on.\\n")
            os.write(2, b"I0000 00:00:1795556702.862845    4534 cpu_feature_guard.cc:227] This binary is optimized.\\n")
            os.write(2, b"To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
                        b"with the appropriate compiler flags.\\n")
            os.write(2, b"E0000 00:00:1795556702.1    4534 cuda_executor.cc:1] failed call to cuInit: none\\n")
            os.write(2, b"E0000 00:00:1795556702.1    4534 rpc.cc:1] peer gone\\n")
            # TensorFlow 2.17-2.19: its own dated format, and its CUDA plugins registered twice
            os.write(2, b"2026-11-27 02:25:05.982650: I external/x/cudart_stub.cc:32] Could not find cuda drivers\\n")
            os.write(2, b"2026-11-27 02:25:27.679433: E external/x/cuda_fft.cc:485] Unable to register cuFFT factory: "
                        b"Attempting to register factory for plugin cuFFT when one has already been registered\\n")
            os.write(2, b"E0000 00:00:1795746331.519941    5131 cuda_dnn.cc:8579] Unable to register cuDNN factory: "
                        b"Attempting to register factory for plugin cuDNN when one has already been registered\\n")
            os.write(2, b"W0000 00:00:1795746331.532782    5131 computation_placer.cc:177] computation placer already "
                        b"registered. Please check linkage and avoid linking the same target more than once.\\n")
            os.write(2, b"2026-11-27 02:25:33.328100: E external/x/cuda_platform.cc:51] failed call to cuInit: "
                        b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\\n")
            os.write(2, b"2026-11-27 02:25:33.3: E external/x/rpc.cc:9] a real error in TensorFlow's own format\\n")
            os.write(2, b"a user's own line\\n")
        os.write(2, b"after\\n")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["E0000 00:00:1795556702.1    4534 rpc.cc:1] peer gone",
                                        "2026-11-27 02:25:33.3: E external/x/rpc.cc:9] a real error in TensorFlow's "
                                        "own format", "a user's own line", "after"]


def test_at_level_0_every_line_shows():
    from sparktrain.host.tflog import StartupFilter

    shown = StartupFilter(0, no_gpu=True)
    for line in ("I0000 00:00:1.5 1 port.cc:153] oneDNN custom operations are on.",
                 "2026-11-27 02:25:27.679433: E external/x/cuda_blas.cc:1452] Unable to register cuBLAS factory: "
                 "Attempting to register factory for plugin cuBLAS when one has already been registered",
                 "E0000 00:00:1.5 1 cuda_platform.cc:52] failed call to cuInit: INTERNAL"):
        assert not shown.drops(line)
    # where the rank uses a GPU, a failed cuInit is a real error at every level
    assert not StartupFilter(2, no_gpu=False).drops("E0000 00:00:1.5 1 cuda_platform.cc:52] failed call to cuInit: x")


def test_the_level_from_the_environment_and_the_callers_default_when_unset():
    from sparktrain.host.tflog import level_from_env

    assert level_from_env({}) == 0  # TensorFlow's own default
    assert level_from_env({}, unset=2) == 2  # a caller that quiets TensorFlow unless told otherwise
    assert level_from_env({"TF_CPP_MIN_LOG_LEVEL": "1"}, unset=2) == 1  # the user's setting wins
    assert level_from_env({"TF_CPP_MIN_LOG_LEVEL": "quiet"}, unset=2) == 0  # not a number: as TensorFlow reads it
