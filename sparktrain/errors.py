"""One error hierarchy. Every message says what was wrong and what to do about it.

Errors raised on the driver survive pickling (``__reduce__``), so they can cross process
boundaries (for example a notebook kernel that pickles exceptions, or a job scheduler).
"""
from __future__ import annotations

import dataclasses
import re
import signal
from typing import Mapping, Sequence


class SparkTrainError(Exception):
    """Base class of every error sparktrain raises.

    ``retryable`` says whether starting the run again could help; ``run(..., max_attempts=N)``
    retries only such failures. Each class sets its default, and the code that raises an error
    may set it otherwise for that one failure.
    """

    retryable: bool = True

    def __reduce__(self):
        return (type(self), self.args)


class InvalidArgumentError(SparkTrainError, ValueError, TypeError):
    """An argument of ``run`` (or a setting) has a bad value or type.

    It is both a ``ValueError`` and a ``TypeError`` so callers may catch either.
    """

    retryable = False  # it would fail the same way again


class UnsupportedError(SparkTrainError, NotImplementedError):
    """A valid call that sparktrain (like Horovod) does not support in this form: an op on
    ``tf.IndexedSlices`` other than Sum or Average, say. A ``NotImplementedError`` (and so a
    ``RuntimeError``), as Horovod raises there."""

    retryable = False


class PicklingFailedError(SparkTrainError):
    """``train_fn``, ``args``, ``kwargs`` or the return value could not be pickled."""

    retryable = False  # it would fail the same way again


class ClusterConfigError(SparkTrainError):
    """The Spark cluster is configured in a way barrier-mode training cannot use."""

    retryable = False  # it would fail the same way again


class InsufficientResourcesError(SparkTrainError):
    """The cluster has fewer task slots or GPUs than the run needs."""


class StartTimeoutError(SparkTrainError, TimeoutError):
    """Not every rank started within ``start_timeout``."""


class RunTimeoutError(SparkTrainError, TimeoutError):
    """The whole run took longer than ``timeout``."""

    retryable = False  # stopped on purpose


class ResultTooLargeError(SparkTrainError):
    """Rank 0's return value is larger than ``spark.driver.maxResultSize`` allows."""

    retryable = False  # it would fail the same way again


class HostsUpdatedInterrupt(SparkTrainError):
    """Horovod's name: the cluster changed, so this attempt ends at its commit (``run_elastic``
    starts the next one at the new size, from that commit)."""


class RunCancelledError(SparkTrainError):
    """The run's Spark job group was cancelled from outside."""

    retryable = False  # stopped on purpose


class RunInUseError(SparkTrainError):
    """A named run (``run_id=``) is being trained by another driver now: its lease in the run's
    home is live. ``holder`` says whose it is (host, process id, start time, expiry)."""

    retryable = False

    def __init__(self, message: str, holder: dict | None = None):
        super().__init__(message)
        self.holder = dict(holder or {})

    def __reduce__(self):
        return type(self), (str(self), self.holder)


class VersionMismatchError(SparkTrainError):
    """An executor runs other versions of Python or key packages than the driver."""

    retryable = False  # it would fail the same way again


# -- storage ---------------------------------------------------------------------------------------

class StorageError(SparkTrainError):
    """A storage operation failed; the message names the URL and what to do, never credentials."""


class BackendMissingError(StorageError, ImportError):
    """The URL's scheme needs a package that is not installed."""

    retryable = False


class UnknownSchemeError(StorageError, ValueError):
    """No fsspec backend knows the URL's scheme."""

    retryable = False


class NotFoundError(StorageError, FileNotFoundError):
    """The container, bucket or checkpoint does not exist (or was never committed)."""


class CredentialsError(StorageError, PermissionError):
    """No credentials, or credentials the service rejects."""

    retryable = False


class ForbiddenError(StorageError, PermissionError):
    """The credentials are valid but may not do this."""

    retryable = False


class CorruptCheckpointError(StorageError):
    """The bytes read do not match the size or checksum recorded when they were written."""


# -- failures of ranks ------------------------------------------------------------------------------

def type_name(exc: BaseException) -> str:
    """The name a failure report gives an exception's type: ``ValueError``, ``pkg.module.Error``."""
    t = type(exc)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    host: str
    local_rank: int
    #: Fully qualified type name of the remote exception, or "" when the process just exited.
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    #: The child's exit code; negative for "killed by signal -exitcode"; None if unknown.
    exitcode: int | None = None
    #: The last lines the rank printed (stdout and stderr interleaved).
    output_tail: tuple[str, ...] = ()
    #: Wall-clock time the failure was seen, for ordering (root cause first).
    time: float = 0.0
    #: Whether starting the run again could help (False for a result too large, mismatched versions).
    retryable: bool = True

    def headline(self) -> str:
        if self.exc_type:
            what = f"{self.exc_type}: {self.message}" if self.message else self.exc_type
        elif self.exitcode is not None and self.exitcode < 0:
            what = f"killed by {signal_name(-self.exitcode)}"
        elif self.exitcode is not None:
            what = f"exited with code {self.exitcode}"
        else:
            what = self.message or "failed"
        return f"rank {self.rank} (local rank {self.local_rank} on {self.host}): {what}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["output_tail"] = list(self.output_tail)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "RankFailure":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["output_tail"] = tuple(kw.get("output_tail") or ())
        return cls(**kw)


#: How the native engine names a peer that died under a collective (``native/shm.c``, ``link.c``).
_DEAD_PEER = re.compile(r"rank (\d+)(?: \(pid \d+[^)]*\))? (?:died|closed its connection)|sending to rank (\d+) failed")


def _dead_peer_first(items: list) -> list:
    """``items`` (failures in time order) with the peer the first one blames first, where that peer failed too."""
    if len(items) < 2:
        return items
    first = items[0]
    found = _DEAD_PEER.search(f"{first.message}\n{first.traceback}")
    if found is None:
        return items
    dead = int(found.group(1) or found.group(2))
    blamed = [f for f in items if f.rank == dead and f.rank != first.rank]
    return blamed + [f for f in items if f not in blamed] if blamed else items


class RankFailedError(SparkTrainError):
    """One or more ranks failed. ``failures`` maps rank to :class:`RankFailure`, root cause first.

    The message leads with the root cause and carries its remote traceback and output tail; the
    other failed ranks follow in time order. The root cause is the first failure in time, unless
    that failure says a peer died under its collective (the native engine's words) and the peer's
    own failure is there too: then the peer's.
    """

    def __init__(self, failures: Sequence[RankFailure] | Mapping[int, RankFailure], attempts: int = 1,
                 earlier: Sequence[str] = (), stall: str = ""):
        items = list(failures.values()) if isinstance(failures, Mapping) else list(failures)
        items.sort(key=lambda f: f.time)
        items = _dead_peer_first(items)
        self.failures: dict[int, RankFailure] = {f.rank: f for f in items}
        #: How many attempts were made (``run(..., max_attempts=N)``), and why the earlier ones failed.
        self.attempts = attempts
        self.earlier = tuple(earlier)
        #: The last stall report of the attempt (``stall_warning``), or "": what late ranks were doing.
        self.stall = stall
        super().__init__(self._message())

    @property
    def root_cause(self) -> RankFailure:
        return next(iter(self.failures.values()))

    @property
    def retryable(self) -> bool:  # type: ignore[override]
        """Another attempt could help only if the root cause could go away."""
        return not self.failures or self.root_cause.retryable

    def _message(self) -> str:
        if not self.failures:
            return "the run failed, but no rank reported why"
        root = self.root_cause
        n = len(self.failures)
        lines = [f"{n} rank{'s' if n > 1 else ''} failed; root cause: {root.headline()}"]
        if root.traceback:
            lines += ["", f"Remote traceback (rank {root.rank}):", root.traceback.rstrip()]
        if root.output_tail:
            lines += ["", f"Last {len(root.output_tail)} output lines of rank {root.rank}:"]
            lines += [f"  {line}" for line in root.output_tail]
        others = list(self.failures.values())[1:]
        if others:
            lines += ["", "Other failed ranks, in the order they failed:"]
            lines += [f"  {f.headline()}" for f in others]
        if self.stall:
            lines += ["", "The last stall report before the failure:", self.stall]
        if self.attempts > 1:
            lines[0] = f"attempt {self.attempts} of {self.attempts}: " + lines[0]
            lines += ["", "Earlier attempts:"] + [f"  attempt {i}: {why}" for i, why in enumerate(self.earlier, 1)]
        return "\n".join(lines)

    def __reduce__(self):
        return (type(self), (list(self.failures.values()), self.attempts, self.earlier, self.stall))

