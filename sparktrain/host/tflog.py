"""TensorFlow's C++ start-up lines: which of them ``TF_CPP_MIN_LOG_LEVEL`` should have hidden.

TensorFlow 2.21 prints its start-up lines (the absl notice, oneDNN, the CUDA stubs) through absl
before it reads ``TF_CPP_MIN_LOG_LEVEL``, twice: once per copy of absl in its shared libraries.
TensorFlow 2.17 and 2.19 print, whatever the variable says, errors that their CUDA plugins were
registered twice (``Unable to register cuFFT/cuDNN/cuBLAS factory``, ``computation placer already
registered``), in absl's format or in TensorFlow's own dated one: a flaw of how those wheels are
linked, harmless on every host. A rank's output pump drops all of these as the level asks
(``executor/output.py``, through :class:`StartupFilter`); on the driver, :func:`filtered_stderr`
does the same while it imports and first runs TensorFlow. At level 0 (``verbose=2``) every line
shows. Pure: no TensorFlow import here.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import Iterator

#: A C++ log line in absl's format, severity letter first (``I0000 00:00:17.5 123 port.cc:153] ...``),
#: or in TensorFlow's own, dated (``2026-11-27 02:25:27.679433: E external/.../cuda_fft.cc:485] ...``).
_CPP_LOG_LINE = re.compile(r"^(?:([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF])) "
                           r"\S+:\d+\] ")
_CPP_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
#: What each of TensorFlow's two copies of absl prints once before its first line.
_ABSL_PREINIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
#: What TensorFlow logs as an error at start-up when it finds no GPU: expected where no GPU is used.
NO_GPU_LINE = re.compile(r"^\S.*[ /]cuda_\w+\.cc:\d+\] failed call to cuInit: ")
#: What TensorFlow 2.17-2.19 log as errors (and warnings) on every host: CUDA plugins registered twice.
_REGISTERED_TWICE = re.compile(r"\] (?:Unable to register cu\w+ factory: Attempting to register factory for plugin \w+ "
                               r"when one has already been registered|computation placer already registered\. )")
#: The second line of TensorFlow's CPU-feature notice, which is not in absl's format.
_CPU_FEATURES = re.compile(r"^To enable the following instructions: .* rebuild TensorFlow with the appropriate "
                           r"compiler flags\.$")
#: What gloo prints on stdout as each of a JAX run's ranks joins the others (jaxlib's CPU collectives).
_GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer "
                             r"ranks is : \d+$")
#: What XLA's coordination service logs (as warnings or errors) as a JAX run's processes leave at the
#: end of a run: one process gone before another's last watch or poll. Harmless; a failure is reported
#: by the rank that failed.
_JAX_SHUTDOWN = re.compile(r"\] .*(?:WatchTasksAsync failed|PollForError\w* .*(?:CANCELLED|Cancelled)|"
                           r"Coordination service (?:agent )?(?:has been |is |was )?shut ?down|"
                           r"Failed to disconnect from coordination service)")


def below_log_level(line: str, level: int) -> bool:
    """Whether ``TF_CPP_MIN_LOG_LEVEL=level`` should have hidden this C++ log line.

    >>> below_log_level("I0000 00:00:1795356405.409084    3599 port.cc:153] oneDNN custom operations are on.", 2)
    True
    >>> below_log_level("E0000 00:00:1795356405.409084    3599 rpc.cc:1] peer gone", 2)
    False
    """
    if line == _ABSL_PREINIT:
        return level >= 1
    m = _CPP_LOG_LINE.match(line)
    return m is not None and _CPP_SEVERITY[m.group(1) or m.group(2)] < level


class StartupFilter:
    """Which of a process's stderr lines to drop at ``TF_CPP_MIN_LOG_LEVEL=level``: C++ lines below
    the level, the CPU-feature notice's second line, and at level 1 or more the plugins'
    registered-twice errors, and, where no GPU is used (``no_gpu``), the failed ``cuInit``; on
    ``stdout``, only gloo's line for each rank that joins a JAX run; XLA's coordination-service lines
    as a JAX run's processes leave, at level 1 or more. At level 0 nothing is dropped. Every other
    line, errors included, passes.

    >>> f = StartupFilter(2, no_gpu=True)
    >>> f.drops("2026-11-27 02:25:27.679433: E external/x/cuda_fft.cc:485] Unable to register cuFFT factory: "
    ...         "Attempting to register factory for plugin cuFFT when one has already been registered")
    True
    >>> f.drops("[Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected peer ranks is : 2",
    ...         "stdout"), f.drops("E0000 00:00:1.5 1 coordination_service_agent.cc:3] WatchTasksAsync failed: "
    ...         "CANCELLED")
    (True, True)
    >>> f.drops("2026-11-27 02:25:27.679433: E external/x/rpc.cc:1] peer gone"), StartupFilter(0).drops(
    ...     "E0000 00:00:1.5 1 cuda_platform.cc:52] failed call to cuInit: INTERNAL")
    (False, False)
    """

    def __init__(self, level: int, no_gpu: bool = True):
        self.level = level
        self.no_gpu = no_gpu
        self._after_cpu_notice = False  # the line after the CPU-feature notice's first line

    def drops(self, line: str, stream: str = "stderr") -> bool:
        if self.level <= 0:
            return False
        if stream != "stderr":
            return bool(_GLOO_CONNECTED.match(line))
        cpp = _CPP_LOG_LINE.match(line)
        hidden = bool(below_log_level(line, self.level) or (self.no_gpu and NO_GPU_LINE.match(line))
                      or (cpp and (_REGISTERED_TWICE.search(line) or _JAX_SHUTDOWN.search(line)))
                      or (self._after_cpu_notice and _CPU_FEATURES.match(line)))
        self._after_cpu_notice = bool(cpp) and "cpu_feature_guard" in line and hidden
        return hidden


def level_from_env(environ=os.environ, unset: int = 0) -> int:
    """``TF_CPP_MIN_LOG_LEVEL`` as TensorFlow reads it: 0 when not a number, ``unset`` when unset
    (0, as TensorFlow takes it; a caller that quiets TensorFlow by default passes its own).

    >>> level_from_env({}), level_from_env({}, unset=2), level_from_env({"TF_CPP_MIN_LOG_LEVEL": "1"}, unset=2)
    (0, 2, 1)
    >>> level_from_env({"TF_CPP_MIN_LOG_LEVEL": "quiet"}, unset=2)
    0
    """
    if "TF_CPP_MIN_LOG_LEVEL" not in environ:
        return unset
    try:
        return int(environ["TF_CPP_MIN_LOG_LEVEL"])
    except ValueError:
        return 0


@contextlib.contextmanager
def filtered_stderr(level: int = 2, no_gpu: bool = True) -> Iterator[None]:
    """While the block runs (TensorFlow's import, and its first op, which looks for a GPU), pass
    this process's stderr through the filter a rank's output gets (:class:`StartupFilter`). Every
    other line reaches stderr unchanged."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    dropped = StartupFilter(level, no_gpu)

    def forward() -> None:
        with os.fdopen(read_end, "r", errors="replace") as lines:
            for line in lines:
                if not dropped.drops(line.rstrip("\n")):
                    os.write(saved, line.encode())

    reader = threading.Thread(target=forward, name="sparktrain-tflog", daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees its end
        reader.join(5)
        os.close(saved)
