"""What a Spark error says, in the words a user needs: the executor's own Python exception where
Spark carried one, the rank's partition, and Spark's context, for ``run``'s errors and
``sparktrain check``."""
from __future__ import annotations

import dataclasses
import re
from typing import Any


_PYTHON_ERROR = re.compile(r"^(\[\w+\] )?[\w.]+(Error|Exception)\b.*:")
_TRACEBACK = "Traceback (most recent call last):"
#: How Spark introduces a Python worker's traceback; with the cause moved first, it would dangle.
_PYTHON_WORKER_SAYS = "[PYTHON_EXCEPTION] An exception was thrown from the Python worker:"


def _error_text(error: Any) -> str:
    java = getattr(error, "java_exception", None)
    return str(java.toString()) if java is not None else str(error)


def python_cause(error: Any) -> str | None:
    """The executor's Python exception (``ModuleNotFoundError: No module named 'x'``) when Spark's
    error carries a Python worker's traceback; None otherwise."""
    text = _error_text(error)
    if "Traceback" not in text:
        return None
    causes = [line.strip() for line in text.splitlines() if _PYTHON_ERROR.match(line.strip())]
    return causes[-1][:500] if causes else None


def spark_error_reason(error: Any, *, with_cause: bool = True) -> str:
    """The informative part of a Spark (or Py4J) error, without the JVM stack.

    py4j puts "An error occurred while calling" first; Spark puts the stage failure after "Job
    aborted due to stage failure:"; a failed Python task carries the worker's traceback, whose
    last "...Error: ..." line is the cause (appended, unless ``with_cause=False``). The reason
    never ends on a bare "Traceback (most recent call last):".
    """
    text = _error_text(error)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("at ")]
    if not lines:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    picked: list[str] = []
    for line in lines:
        if "Job aborted due to stage failure:" in line:
            picked = [line.split("Job aborted due to stage failure:", 1)[1].strip()]
        elif picked and ("Exception:" in line or "Failure" in line) and len(picked) < 2:
            picked.append(line.split("Exception: ", 1)[-1])
    if not picked:
        picked = [next((line for line in lines if not line.startswith("An error occurred while calling")), lines[0])]
    reason = " ".join(p for p in picked if p != _TRACEBACK).removesuffix(_TRACEBACK).strip()
    cause = python_cause(error) if with_cause else None
    if cause and cause not in reason:
        reason = f"{reason[:300]} ... {cause}"
    return reason[:800]


@dataclasses.dataclass(frozen=True)
class SparkFailure:
    """What a failed barrier job's error says: which task (its partition) failed, the executor's
    Python exception when Spark carried one, and Spark's own context.

    A task's partition is not its rank: ranks are numbered by host (``seam.topology.ranks_by_host``),
    so the caller names the rank where it knows which rank that task ran."""

    partition: int | None
    cause: str | None
    context: str

    def message(self, run: str, rank: int | None = None) -> str:
        """``rank 1: ModuleNotFoundError: ...`` first, then ``<run> failed in Spark: <context>``."""
        if self.cause:
            where = (f"rank {rank}: " if rank is not None else
                     f"the task of partition {self.partition}: " if self.partition is not None else "")
            return f"{where}{self.cause}\n{run} failed in Spark: {self.context}"
        return f"{run} failed in Spark: {self.context}"


def read_spark_failure(error: Any) -> SparkFailure:
    """Read a failed barrier job's error (see :class:`SparkFailure`)."""
    task = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", _error_text(error))
    context = spark_error_reason(error, with_cause=False).removesuffix(_PYTHON_WORKER_SAYS).strip()
    return SparkFailure(int(task.group(1)) if task else None, python_cause(error), context)
