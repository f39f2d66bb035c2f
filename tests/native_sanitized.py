"""Run by tests/test_native_sanitizer.py under an ASan+UBSan build of the engine: the correctness
cases over shared memory, the forced TCP ring and two hosts, plus the other collectives and a
disagreement. Exits 0 when every rank got the right answer."""
from __future__ import annotations

import sys

import native_ranks as nr


def main() -> int:
    failures = []
    cases = [
        (3, {}, nr.correctness, ((0, 1, 7, 1024, 100_003),)),
        (3, {"tcp": True}, nr.correctness, ((0, 1, 7, 1024, 100_003),)),
        (4, {"hosts": ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]}, nr.correctness, ((0, 7, 100_003),)),
        (3, {}, nr.other_ops, ()),
        (3, {"tcp": True}, nr.other_ops, ()),
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
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
