"""How a rank ended, as the barrier task reads it: its exit code, ``error.json``, and rank 0's
result, which travels back in chunks or, when too large for Spark, through storage."""
from __future__ import annotations

import json
import os
import traceback
from typing import Iterator

from ..seam import protocol
from ..errors import RankFailure, ResultTooLargeError, SparkTrainError, type_name
from ..host.localfiles import file_chunks
from ..seam.protocol import RankError
from ..seam.spec import SPILLED
from .child import EXIT_NOT_LET_GO
from .output import RankIO
from . import workdirs

#: Size of the pieces rank 0's pickled result travels in: well inside the 4 MiB Arrow batches
#: a Spark Connect server sends (``spark.connect.grpc.arrow.maxBatchSize``).
RESULT_CHUNK = 1024 * 1024



def outcome(state: RankIO, code: int, workdir: str) -> RankError | None:
    """The failure a rank's exit shows, or None when it succeeded."""
    error_path = os.path.join(workdir, workdirs.ERROR)
    if code == 0 and not os.path.exists(error_path):
        if state.rank == 0 and not os.path.exists(os.path.join(workdir, workdirs.VALUE)):
            try:
                held = "which holds " + ", ".join(sorted(os.listdir(workdir)))
            except OSError:
                held = "which is gone"
            return failed(state, state.failure(exitcode=code, exc_type="SparkTrainError", message=(
                f"rank 0's process exited with code 0 but left no result in {workdir} ({held})")))
        return None
    info = {}
    if os.path.exists(error_path):
        with open(error_path) as f:
            info = json.load(f)
    elif code == EXIT_NOT_LET_GO:
        info = {"exc_type": "SparkTrainError",
                "message": f"rank {state.rank}'s process was started held and never let go: it ran nothing"}
    return failed(state, state.failure(exitcode=code, **info))


def failed(state: RankIO, failure: RankFailure) -> RankError:
    """The rank's one report of its failure: the channel's ``failed`` message, or, where the
    channel cannot carry it, the same message inside the task's error (``protocol.RankError``)."""
    delivered = state.send(protocol.RankFailed(failure)) and state.settle()  # the driver has it
    # The report travels inside Spark's exception text only when the channel could not carry
    # it: otherwise Spark's own log lines would repeat it, traceback and all, for every rank.
    return RankError(failure, carry_report=not delivered)


def start_failure(state: RankIO, error: Exception) -> Exception:
    """What the task raises when its rank could not start: the rank's report of ``error`` (sent as
    by :func:`failed`), or, when the driver stopped the rank while the ranks met, ``error`` alone:
    a rank stopped because of another is not a root cause, and reports nothing."""
    if isinstance(error, SparkTrainError) and state.abort_reason is not None:
        return error
    if isinstance(error, SparkTrainError):
        return failed(state, state.failure(exc_type=type_name(error), message=str(error),
                                           retryable=error.retryable))
    return failed(state, state.failure(exc_type=type_name(error), message=str(error),
                                       traceback=traceback.format_exc()))


def result_chunks(state: RankIO, path: str) -> Iterator[bytes]:
    size = os.path.getsize(path)
    limit = state.spec.max_result_bytes
    # Spark counts serialized task results against spark.driver.maxResultSize; leave it headroom.
    if limit and size + (1 << 20) > limit:
        if state.spec.spill_url:
            from .. import storage

            url = f"{state.spec.spill_url.rstrip('/')}/sparktrain-{state.spec.run_id}/value.pkl"
            try:
                storage.put_file(path, url)
            except Exception as e:  # noqa: BLE001
                raise failed(state, state.failure(exc_type=type_name(e), message=(
                    f"rank 0's return value ({size / 2**20:.1f} MiB pickled) is too large for "
                    f"spark.driver.maxResultSize and could not be spilled to {url}: {e}"))) from None
            yield SPILLED + url.encode()
            return
        err = ResultTooLargeError(
            f"rank 0's return value is {size / 2**20:.1f} MiB pickled, more than spark.driver.maxResultSize "
            f"({limit / 2**20:.0f} MiB) allows. Pass checkpoint_url= to send it straight to storage, set "
            "spark.sparktrain.spillUrl to a storage prefix the driver can read, or raise "
            f"spark.driver.maxResultSize (for example to {max(2 * size, 1 << 30) // 2**20}m)"
        )
        raise failed(state, state.failure(exc_type=type_name(err), message=str(err), retryable=err.retryable))
    yield from file_chunks(path, RESULT_CHUNK)


