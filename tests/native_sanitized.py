"""Run by tests/test_native_sanitizer.py under an ASan+UBSan build of the engine: the correctness
cases over shared memory, the forced TCP ring and two hosts (every op of every dtype included),
the other collectives (reducescatter and alltoall too, also over three hosts), the pipelined
allreduce across hosts (its ring thread), disagreements with the collectives
that follow them, and a leader killed on a ring of four. Exits 0 when every rank got the right
answer."""
from __future__ import annotations

import os
import signal
import sys

import native_ranks as nr


TWO_HOSTS = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
THREE_HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.1", "127.0.0.3", "127.0.0.2"]  # blocks passed on; hosts' ranks interleaved


def _scatter_and_alltoall(comm):
    return {"bad": nr.reducescatter_cases(comm) + nr.alltoall_cases(comm)}


def main() -> int:
    failures = []
    cases = [
        (3, {}, nr.correctness, ((0, 1, 7, 1024, 100_003),)),
        (3, {"tcp": True}, nr.correctness, ((0, 1, 7, 1024, 100_003),)),
        (4, {"hosts": ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]}, nr.correctness, ((0, 7, 100_003),)),
        (3, {}, nr.other_ops, ()),
        (3, {"tcp": True}, nr.other_ops, ()),
        (3, {}, nr.every_op, ((0, 7, 1003),)),
        (3, {"tcp": True}, nr.every_op, ((0, 7, 1003),)),
        (4, {"hosts": TWO_HOSTS}, nr.every_op, ((0, 7),)),
        (3, {}, _scatter_and_alltoall, ()),
        (3, {"tcp": True}, _scatter_and_alltoall, ()),
        (4, {"hosts": TWO_HOSTS}, _scatter_and_alltoall, ()),
        (5, {"hosts": THREE_HOSTS}, nr.other_ops, ()),
        (5, {"hosts": THREE_HOSTS}, _scatter_and_alltoall, ()),
        (4, {"hosts": TWO_HOSTS}, nr.pipelined, ((("float32", "sum"), ("float16", "max")), ("float32",))),
    ]
    for n, kw, fn, args in cases:
        results = nr.run_ranks(n, fn, *args, **kw)
        bad = {r: v for r, (s, v) in results.items() if s != "ok" or (isinstance(v, dict) and v.get("bad"))}
        if sorted(results) != list(range(n)) or bad:
            failures.append(f"{fn.__name__} n={n} {kw}: reported {sorted(results)}, bad {bad}")
    for tcp in (False, True):
        results = nr.run_ranks(2, nr.mismatched, tcp=tcp, timeout=30)
        if sorted(results) != [0, 1] or any(s != "error" or "the shapes differ" not in v for s, v in results.values()):
            failures.append(f"mismatch tcp={tcp}: {results}")
    for n, deviants, kw in ((3, {2}, {}), (3, {1}, {"tcp": True}), (4, {3}, {"hosts": TWO_HOSTS}),
                            (4, {2, 3}, {"hosts": TWO_HOSTS})):
        results = nr.run_ranks(n, nr.disagreements, deviants, timeout=30, **kw)
        values = [v for s, v in results.values() if s == "ok"]
        if len(values) != n or any(v != values[0] for v in values) or \
                any(v.get(k) != [float(n)] * 3 for v in values for k in v if k.endswith(" then")):
            failures.append(f"disagreements {kw} {deviants}: {results}")
    # A leader killed mid-allreduce on a ring of four: the abort record goes round to every survivor.
    started = nr.CONTEXT.Event()

    def kill_rank_2(procs):
        if started.wait(60):
            os.kill(procs[2].pid, signal.SIGKILL)

    results = nr.run_ranks(4, nr.allreduce_until_it_fails, 2, started, tcp=True, timeout=30, on_start=kill_rank_2)
    if sorted(results) != [0, 1, 3] or any(s != "ok" or "rank 2" not in v["message"] for s, v in results.values()):
        failures.append(f"killed rank 2 of 4 over tcp: {results}")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
