"""Helpers the benchmark scripts share: machine description, settling, timing, tables, RESULTS.md sections."""
from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import sys
import time
import traceback


def settle(max_wait: float = 15.0, busy_percent: float = 25.0) -> None:
    """Wait (bounded) until the machine is quiet, so the previous contender's teardown
    (a torchrun tree exiting, a JVM collecting garbage) is not charged to the next one."""
    import psutil

    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline and psutil.cpu_percent(interval=0.25) > busy_percent:
        pass


def median_seconds(call, iters: int) -> float:
    """``call()`` once untimed (the warm-up), then the median of ``iters`` timed calls, in seconds."""
    call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class HostSteal:
    """The share of this machine's CPU time that the hypervisor gave elsewhere since it was made
    (the steal column of /proc/stat; 0 where there is none). On a shared virtual machine it comes
    in bursts of seconds that slow every contender they hit; a benchmark reports it beside its
    figures so that a disturbed run shows as one."""

    def __init__(self):
        self.ticks, self.started = self.read(), time.monotonic()

    @staticmethod
    def read() -> int:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return 0
        return int(fields[8]) if len(fields) > 8 and fields[0] == "cpu" else 0

    def share(self) -> float:
        elapsed = time.monotonic() - self.started
        if elapsed <= 0:
            return 0.0
        return (self.read() - self.ticks) / os.sysconf("SC_CLK_TCK") / (elapsed * (os.cpu_count() or 1))


class GlooGroup:
    """This process's place in a Gloo group (``torch.distributed``), for timing its allreduce."""

    def __init__(self, init_method: str, rank: int, n: int):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=n)

    def make(self, nbytes: int):
        """A call that sums ``nbytes`` of float32 zeros in place over the group (they stay zeros)."""
        t = self.torch.zeros(nbytes // 4, dtype=self.torch.float32)
        return lambda: self.dist.all_reduce(t)

    def agree(self, count: int) -> int:
        """Rank 0's ``count``, on every rank."""
        t = self.torch.tensor([count], dtype=self.torch.int64)
        self.dist.broadcast(t, 0)
        return int(t.item())

    def close(self) -> None:
        self.dist.destroy_process_group()


def failed(name: str, exc: BaseException, when: str = "") -> str:
    """A contender's status after ``exc``: ``failed: <short reason>`` for the table; its full
    traceback goes to stderr between two marker lines. One contender failing must not stop the
    others, so the scripts carry on after this."""
    print(f"--- {name} failed{' during ' + when if when else ''}; full error follows ---", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"--- end of {name} error ---", file=sys.stderr, flush=True)
    return f"failed: {short_reason(exc)}"


def short_reason(exc: BaseException, limit: int = 160) -> str:
    """One line out of an exception, preferring the innermost ``SomeError: message`` line.

    Spark wraps a task's Python traceback (and a JVM stack) inside its own message; the last
    ``...Error:``/``...Exception:`` line is usually the one that says what went wrong.
    """
    text = f"{type(exc).__name__}: {exc}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pattern = re.compile(r"^([\w.]+(Error|Exception|Exit|Interrupt)):\s*\S")
    picked = [ln for ln in lines if pattern.match(ln) and not ln.startswith("at ")]
    line = picked[-1] if picked else (lines[0] if lines else type(exc).__name__)
    line = re.sub(r"\s+", " ", line).replace("|", "/")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def nproc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_line(dists, master: str | None = None) -> str:
    """nproc, CPU, Python, Spark (or local mode), the versions of ``dists`` and the date."""
    parts = [f"nproc {nproc()}", f"CPU {cpu_model()}", f"Python {platform.python_version()}"]
    if master:
        parts += [f"pyspark {version('pyspark')}", f"master {master}"]
    else:
        parts.append("local mode (no Spark)")
    for dist in dists:
        v = version(dist)
        if v:
            parts.append(f"{dist} {v}")
    parts.append(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    return ", ".join(parts)


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table; the first column left-aligned. A row shorter than the header (a failed
    contender and its reason) takes the rest of the line instead of widening the columns."""
    full = [r for r in rows if len(r) == len(header)]
    widths = [max([len(header[i])] + [len(r[i]) for r in full]) for i in range(len(header))]

    def line(cells):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append(line(r) if len(r) == len(header) else "  ".join([r[0].ljust(widths[0]), *r[1:]]))
    return "\n".join(out)


def write_section(path: str, begin: str, end: str, title: str, intro: str, machine: str, command: str,
                  header: list[str], rows: list[list[str]], before_command=(), after_table=(),
                  first_left: bool = True) -> None:
    """Put this benchmark's section into the results file ``path`` and say so.

    The section runs from ``begin`` through ``end`` (each script has its own markers): a heading,
    what was measured, the machine, any ``before_command`` paragraphs, the command, the table and
    any ``after_table`` paragraphs. It takes the old section's place, or goes at the end; the rest
    of the file is kept. A row shorter than the header (a failed contender and its reason) is
    padded with empty cells.
    """
    lines = [begin, f"## {title}", "", intro, "", f"Machine: {machine}", ""]
    for paragraph in before_command:
        lines += [paragraph, ""]
    lines += [f"Command: `{command}`", "", "| " + " | ".join(header) + " |",
              "|" + "|".join(([":---"] if first_left else ["---:"]) + ["---:"] * (len(header) - 1)) + "|"]
    for r in rows:
        cells = list(r) + [""] * (len(header) - len(r))
        lines.append("| " + " | ".join(v.replace("|", "/") for v in cells) + " |")
    for paragraph in after_table:
        lines += ["", paragraph]
    lines.append(end)
    section = "\n".join(lines) + "\n"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    start = text.find(begin)
    if start >= 0:
        stop = text.find(end, start)
        tail = text[stop + len(end):].lstrip("\n") if stop >= 0 else ""
        text = text[:start] + section + ("\n" + tail if tail else "")
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + section
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    print(f"wrote the section {title!r} of {path}")
