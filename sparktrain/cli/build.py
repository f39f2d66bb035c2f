"""``sparktrain check --build``: compile the TensorFlow kernels into the kernel cache of every
executor's host (and of the driver's host) ahead of a run, so that no rank's ``init()`` waits for
the compiler; with ``SPARKTRAIN_CACHE_DIR`` on a shared mount, one host's build serves every host
with the same installation."""
from __future__ import annotations

from ..driver import face
from ..driver.face import probe
from ..engine import kernel_cache

#: Seconds the build stage may take on top of the check's timeout: one compile, and the import of TensorFlow.
BUILD_SECONDS = 360.0


def build_here() -> dict:
    """Compile the kernels here where the cache lacks them: ``{"built": seconds or None, "error": ...,
    "tf_kernels": the plan after}``."""
    import time

    plan = kernel_cache.plan()
    found = {"built": None, "error": None}
    if plan["path"] == "compile":
        started = time.monotonic()
        try:
            from sparktrain.tensorflow import kernels

            kernels.build()
            found["built"] = time.monotonic() - started
        except Exception as e:  # noqa: BLE001 - why it did not build is the finding
            found["error"] = f"{type(e).__name__}: {e}"
        plan = kernel_cache.plan()
    elif plan["path"] == "fallback" and not plan["why"].startswith("turned off"):
        found["error"] = plan["why"]
    return {**found, "tf_kernels": plan}


def task_function():
    """Each task of the build stage: :func:`build_here`, reported with its task and address."""
    return probe.stage_task(lambda _ctx: build_here())


def build(report, view, driver: dict, tasks: list[dict], local: bool, timeout: float) -> None:
    """Build on the driver (unless local mode, where the tasks share its host) and in one barrier
    stage of ``len(tasks)`` tasks; report what each host did; the tasks' and driver's
    ``tf_kernels`` become the plans after."""
    report.line()
    report.line("Building the TensorFlow kernels (--build)")
    if not local and driver.get("tf_kernels", {}).get("path") == "compile":
        done = build_here()
        driver["tf_kernels"] = done["tf_kernels"]
        _say(report, "the driver's host", [done])
    if not tasks:
        return
    found = probe.run(view, len(tasks), None, timeout=timeout + BUILD_SECONDS, task=task_function(),
                      description=f"sparktrain check --build: {len(tasks)} task(s) compile the TensorFlow kernels")
    if found.timed_out or found.error is not None:
        why = "did not finish in time" if found.timed_out else face.spark_error_reason(found.error)
        report.fail(f"the build stage of {len(tasks)} task(s) failed: {why}")
        return
    hosts: dict[str, list[dict]] = {}
    for t, done in zip(tasks, found.tasks):
        t["tf_kernels"] = done["tf_kernels"]
        hosts.setdefault(done["address"].rsplit(":", 1)[0], []).append(done)
    for host, done in hosts.items():
        _say(report, f"executor host {host}", done)
    if driver.get("tf_kernels"):  # the tasks may have built the driver's host's too (local mode)
        driver["tf_kernels"] = kernel_cache.plan()


def _say(report, where: str, done: list[dict]) -> None:
    errors = sorted({d["error"] for d in done if d["error"]})
    built = [d["built"] for d in done if d["built"] is not None]
    if errors:
        report.fail(f"{where}: the kernels did not build: {errors[0]}")
    elif built:
        report.ok(f"{where}: compiled into {done[0]['tf_kernels']['cache']} ({max(built):.1f} s)")
    else:
        report.ok(f"{where}: {kernel_cache.describe(done[0]['tf_kernels'])}")
