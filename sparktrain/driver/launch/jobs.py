"""What an attempt waits on: a barrier Spark job, or local mode's threads, behind one protocol.

This is the only driver module that names the executor side, and only lazily, inside the functions
that ship a rank's work: ``sparktrain.executor.task`` is imported where a job starts its ranks.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

from ...seam.spec import OUTPUT_SEQ, RESULT_SCHEMA, TaskSpec
from .cluster import without_pyspark_warnings


#: Seconds between two hushes of Spark's console progress bar (it stays away 500 ms after each).
HUSH_SECONDS = 0.3


class Job(Protocol):
    """A run's ranks at work in the background. ``on_done`` (given to the constructor) is called
    once, from the job's own thread, when it ends."""

    #: Why the job failed, once it is done; None if it succeeded.
    error: BaseException | None

    def start(self) -> None: ...

    def done(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...

    def cancel(self) -> None: ...

    def result_bytes(self) -> bytes | None: ...


#: Builds the job of one attempt from its spec and the callback it calls when it ends.
JobFactory = Callable[[TaskSpec, Callable[[], None]], Job]


class _Background:
    """Runs ``body`` on a daemon thread; records its result or error; says when it is done."""

    def __init__(self, name: str, on_done: Callable[[], None]):
        self.error: BaseException | None = None
        self.value: Any = None
        self._on_done = on_done
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _body(self) -> Any:
        raise NotImplementedError

    def _main(self) -> None:
        try:
            self.value = self._body()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits on the job
            self.error = e
        finally:
            self._done.set()
            self._on_done()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


class BarrierJob(_Background):
    """One Spark job, collected on a background thread under its own job group, so it can be cancelled.

    ``collect`` builds and collects the barrier stage; ``rows`` holds what it returned.

    ``view`` (``sparktrain.driver.launch.views``) puts the job in its group and cancels it.

    >>> job = BarrierJob(view, "probe-1", "a probe", lambda: df.mapInArrow(f, schema, barrier=True).collect())  # doctest: +SKIP
    >>> job.start(); job.wait(60) or job.cancel()                                                     # doctest: +SKIP
    """

    def __init__(self, view, group: str, description: str, collect: Callable[[], list],
                 on_done: Callable[[], None] = lambda: None):
        super().__init__(f"sparktrain-job-{group}", on_done)
        self.view = view
        self.group = group
        self.description = description
        self._collect = collect
        self._hushed = float("-inf")

    @property
    def rows(self) -> list | None:
        return self.value

    def _body(self) -> list:
        with self.view.group(self.group, self.description):
            return self._quiet_collect()

    def _quiet_collect(self) -> list:
        """Collect, without the warnings pyspark gives for it (``cluster.without_pyspark_warnings``)."""
        with without_pyspark_warnings():
            return self._collect()

    def cancel(self) -> None:
        self.view.cancel(self.group)

    def hush(self, now: float) -> None:
        """While the stage runs, keep Spark's console progress bar off the ranks' lines (every
        HUSH_SECONDS at most: the bar stays away 500 ms after each call)."""
        if not self.done() and now - self._hushed >= HUSH_SECONDS:
            self._hushed = now
            self.view.hush_console_progress()


class SparkJob(BarrierJob):
    """A run's ranks: one barrier stage of ``spec.size`` tasks, each running ``executor.task.barrier_task``.

    The stage reads ``source`` (the fed DataFrames, in ``spec.size`` partitions; see
    ``driver.launch.feed``), or one row per task when no data is fed.
    """

    def __init__(self, view, spec: TaskSpec, fn_name: str, on_done: Callable[[], None], source=None,
                 profile=None):
        super().__init__(view, f"sparktrain-{spec.run_id}",
                         f"sparktrain.run({fn_name}) num_proc={spec.size} run {spec.run_id}",
                         self._launch, on_done)
        self.spec = spec
        self.source = source
        #: The run's own pyspark ResourceProfile (``run(..., resources=...)``); None: the default one.
        self.profile = profile

    def _launch(self) -> list:
        from ...executor.task import barrier_task  # the one entry into the executor side

        df = self.source if self.source is not None else self.view.spark.range(0, self.spec.size, 1, self.spec.size)
        # profile= exists from pyspark 4.0 only; without a profile, the call stays 3.5-compatible.
        extra = {"profile": self.profile} if self.profile is not None else {}
        return df.mapInArrow(barrier_task(self.spec), RESULT_SCHEMA, barrier=True, **extra).collect()

    def result_bytes(self) -> bytes | None:
        chunks = sorted((r["seq"], r["data"]) for r in self.rows or () if r["rank"] == 0 and r["seq"] >= 0)
        return b"".join(bytes(d) for _, d in chunks) if chunks else None

    def output_tails(self) -> dict[int, list[str]]:
        """Each rank's output tail, when the ranks sent it back (``TaskSpec.return_output``)."""
        return {r["rank"]: bytes(r["data"]).decode(errors="replace").split("\n")
                for r in self.rows or () if r["seq"] == OUTPUT_SEQ}


class LocalJob(_Background):
    """Local mode: each rank's task-side code runs on a driver thread; no Spark."""

    def __init__(self, spec: TaskSpec, gpus: list[list[str]] | None, on_done: Callable[[], None]):
        super().__init__(f"sparktrain-local-{spec.run_id}", on_done)
        self.spec = spec
        self.gpus = gpus

    def _body(self) -> list[bytes] | None:
        from ...executor.task import run_rank  # the one entry into the executor side

        chunks: dict[int, list[bytes]] = {}
        errors: dict[int, BaseException] = {}

        def rank_main(rank: int) -> None:
            try:
                chunks[rank] = list(run_rank(self.spec, rank, "127.0.0.1", self.gpus[rank] if self.gpus else None))
            except BaseException as e:  # noqa: BLE001 - the lowest failed rank's error is the job's
                errors[rank] = e

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"sparktrain-local-{r}", daemon=True)
                   for r in range(self.spec.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[min(errors)]
        return chunks.get(0)

    def cancel(self) -> None:
        pass  # the ranks stop when the channel tells them to, or when the channel closes

    def result_bytes(self) -> bytes | None:
        return b"".join(self.value) if self.value else None
