"""``sparktrain check``'s findings about what each executor can do for a rank: which engine its
CPU collectives run on, and whether it can encrypt, and the ``Report`` that collects and prints
every finding of ``sparktrain.cli.check``."""
from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ..settings import Settings


class Report:
    """Collects findings and prints them as they come, so a slow step shows where it is."""

    def __init__(self, out: TextIO):
        self.out = out
        self.failures: list[str] = []
        self.warnings: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def field(self, label: str, value: str, width: int = 18) -> None:
        self.line(f"  {label:<{width}} {value}")

    def ok(self, text: str) -> None:
        self.line(f"  [ok]   {text}")

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        self.line(f"  [WARN] {text}")

    def fail(self, text: str) -> None:
        self.failures.append(text)
        self.line(f"  [FAIL] {text}")

    def table(self, rows: list[list[str]]) -> None:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            self.line("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())

    def finish(self) -> int:
        self.line()
        if self.failures:
            self.line(f"Result: {len(self.failures)} problem(s) would make sparktrain.run fail here:")
            for text in self.failures:
                self.line(f"  - {text}")
            return 1
        extra = f" ({len(self.warnings)} warning(s) above)" if self.warnings else ""
        self.line(f"Result: OK, sparktrain.run can launch on this cluster{extra}")
        return 0


def where(tasks: list[dict]) -> str:
    names = [f"task {t['task']} at {t['address']}" for t in tasks]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def engines(report: Report, driver: dict, tasks: list[dict]) -> None:
    """Which engine CPU collectives run on, per executor: native where it was built, else TensorFlow's ring."""
    report.line()
    report.line("Collectives on CPU (spark.sparktrain.cpuCollectives)")
    engines = [t.get("cpu_engine") or "unknown" for t in tasks]
    native_there = sum(1 for e in engines if e == "native")
    here = driver.get("cpu_engine") or "unknown"
    report.field("engine", f"driver: {here.split(' (')[0]}" +
                 (f"; executors: native on {native_there} of {len(tasks)}" if tasks else ""))
    others: dict[str, list[dict]] = {}
    for t, e in zip(tasks, engines):
        if e != "native":
            others.setdefault(e, []).append(t)
    for e, ts in others.items():
        report.warn(f"{where(ts)}: CPU collectives fall back to {e}; reinstall sparktrain there where gcc is "
                    "available so that its native engine is built")


def encryption(report, driver: dict, tasks: list[dict], setting: str, on: bool) -> None:
    """Whether the driver and each executor can encrypt (libcrypto for the channel and the native
    ring), and whether this conf's runs would be (``setting`` resolved, to ``on``)."""
    report.line()
    report.line("Encryption (spark.sparktrain.encryption)")
    able = [t for t in tasks if not t.get("crypto")]
    here = driver.get("crypto")
    report.field("encryption", f"{setting}: runs here are "
                 f"{'encrypted' if on else 'not encrypted'}; driver: {'can encrypt' if not here else 'cannot'}"
                 + (f"; executors: can encrypt on {len(able)} of {len(tasks)}" if tasks else ""))
    cannot = [t for t in tasks if t.get("crypto")]
    problems = ([f"the driver cannot encrypt: {here}"] if here else []) + \
        ([f"{where(cannot)} cannot encrypt: {cannot[0]['crypto']}"] if cannot else [])
    for text in problems:
        (report.fail if on else report.warn)(text + ("" if on else " (encryption is off for runs here)"))


def kernels(report, driver: dict, tasks: list[dict], values: Settings) -> None:
    """Which path each host's ranks take for the TensorFlow kernels (cached, compiled at the first
    ``init()``, or the ``tf.numpy_function`` fallback), why, and where the cache is. ``values``: the
    settings as a run here resolves them (``driver.launch.config.settings_of``)."""
    from ..engine import kernel_cache

    report.line()
    report.line("TensorFlow kernels of the native engine (spark.sparktrain.tfKernels; SPARKTRAIN_CACHE_DIR, CXX)")
    if not values.tf_kernels and values.origin("tf_kernels") != "default":
        report.field("every rank", f"{kernel_cache.FALLBACK}: turned off by the tf_kernels setting "
                     "(spark.sparktrain.tfKernels or SPARKTRAIN_TF_KERNELS)")
        return
    hosts: dict[tuple[str, str], list[dict]] = {}
    for t in tasks:
        plan = t.get("tf_kernels") or {"path": "unknown", "why": "not reported", "cache": None}
        hosts.setdefault((t["address"].rsplit(":", 1)[0], kernel_cache.describe(plan)), []).append(t)
    rows = [("the driver", kernel_cache.describe(driver["tf_kernels"]))] if driver.get("tf_kernels") else []
    rows += [(f"{host} ({len(ts)} task(s))", text) for (host, text), ts in hosts.items()]
    width = max([18, *(len(label) for label, _ in rows)])
    for label, text in rows:
        report.field(label, text, width)
    fallback: dict[str, list[dict]] = {}
    for t in tasks:
        plan = t.get("tf_kernels") or {}
        if plan.get("path") == "fallback" and not plan["why"].startswith("turned off"):
            fallback.setdefault(plan["why"], []).append(t)
    for why, ts in fallback.items():
        report.warn(f"{where(ts)}: collectives inside tf.function run through tf.numpy_function ({why}), slower "
                    "than the kernels; install g++ there, or compile the kernels once into a shared "
                    "SPARKTRAIN_CACHE_DIR from a host with the same installation (sparktrain check --build)")
