"""``SparkBackend``: Horovod's ``horovod.spark.common.backend.SparkBackend``, for ``KerasEstimator(backend=...)``.

It says how many ranks a fit runs and how they run: its keywords are Horovod's, and each means
what ``sparktrain.run``'s keyword of the same name means. ``fit`` passes them to the run.

    from sparktrain.ml import KerasEstimator, SparkBackend
    backend = SparkBackend(num_proc=4, stdout=sys.stdout, stderr=sys.stderr, prefix_output_with_timestamp=True)
    KerasEstimator(backend=backend, ...)
"""
from __future__ import annotations

from typing import IO, Any, Iterable, Mapping

from ..errors import InvalidArgumentError, UnsupportedError

#: Horovod's keywords that sparktrain.run takes under the same name and meaning.
RUN_KEYWORDS = ("stdout", "stderr", "prefix_output_with_timestamp", "start_timeout", "verbose", "nics")


class SparkBackend:
    """How many ranks ``KerasEstimator.fit`` runs, and how: Horovod's ``SparkBackend``.

    Parameters
    ----------
    num_proc : the number of ranks; None (Horovod's default) uses every task slot of the cluster.
    env : extra environment variables for every rank (Horovod: the ranks' whole environment,
        which sparktrain builds itself; these are added to it).
    stdout, stderr : where the ranks' output lines go (default ``sys.stdout``/``sys.stderr``).
        Not saved with the estimator: a stream does not outlive the process.
    prefix_output_with_timestamp : put the time before each rank's output line.
    start_timeout : seconds for every rank to start and check in.
    verbose : ``sparktrain.run``'s verbosity (0, 1 or 2); default the estimator's ``verbose``.
    nics : the network interfaces or subnets the ranks use, as ``sparktrain.run``'s ``nics``.
    use_gloo : accepted: sparktrain's own engine runs the collectives over TCP and shared memory,
        without MPI, as Gloo did.
    use_mpi, extra_mpi_args : refused when set: there is no MPI here.

    >>> SparkBackend(num_proc=2).num_processes()
    2
    """

    def __init__(self, num_proc: int | None = None, env: Mapping[str, str] | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 prefix_output_with_timestamp: bool = False, start_timeout: float | None = None,
                 verbose: int | None = None, nics: str | Iterable[str] | None = None,
                 use_mpi: bool | None = None, use_gloo: bool | None = None, extra_mpi_args: str | None = None):
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
            raise InvalidArgumentError(f"SparkBackend(num_proc={num_proc!r}): give a positive number of ranks, or None "
                                       "for every task slot of the cluster")
        if env is not None and (not isinstance(env, Mapping)
                                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise InvalidArgumentError(f"SparkBackend(env={env!r}): give a dict of str to str, e.g. "
                                       "env={'TF_CPP_MIN_LOG_LEVEL': '2'}")
        if use_mpi:
            raise UnsupportedError("SparkBackend(use_mpi=True): sparktrain has no MPI; its own engine runs the "
                                   "collectives over TCP and shared memory. Leave use_mpi out")
        if extra_mpi_args:
            raise UnsupportedError(f"SparkBackend(extra_mpi_args={extra_mpi_args!r}): there is no mpirun here to pass "
                                   "them to. Leave extra_mpi_args out; sparktrain.run's settings (docs/settings.md) "
                                   "tune the engine")
        self.num_proc = num_proc
        self.env = dict(env or {})
        self.stdout, self.stderr = stdout, stderr
        self.prefix_output_with_timestamp = prefix_output_with_timestamp
        self.start_timeout, self.verbose, self.nics = start_timeout, verbose, nics
        self.use_gloo = use_gloo

    def num_processes(self) -> int | None:
        """The number of ranks (Horovod's name); None: every task slot of the cluster."""
        return self.num_proc

    def run_kwargs(self) -> dict[str, Any]:
        """The keywords ``fit`` passes to ``sparktrain.run`` (those left at their defaults are left out)."""
        values = {name: getattr(self, name) for name in RUN_KEYWORDS}
        return {k: v for k, v in values.items() if v is not None and v is not False}

    def __getstate__(self) -> dict:
        # A saved estimator keeps its backend, but not the output streams, which do not outlive the process.
        return {**self.__dict__, "stdout": None, "stderr": None}

    def __repr__(self) -> str:
        return f"SparkBackend(num_proc={self.num_proc!r})"
