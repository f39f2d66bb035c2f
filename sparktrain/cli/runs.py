"""``sparktrain runs <elastic_url>``: the named runs under an ``elastic_url``, one line each: id,
state (running, finished, failed), last commit (epoch, batch, time) and lease
(``sparktrain.storage.home``). ``--json`` prints the same as a list of objects."""
from __future__ import annotations

import json
from typing import Any, Mapping

from ..storage import home as homes, lease as leases


def describe(elastic_url: str, storage_options: Mapping[str, Any] | None = None) -> list[dict]:
    """One dict per run under ``elastic_url``: ``run_id``, ``state``, ``last_commit``, ``lease``,
    ``finished`` and ``failure``."""
    rows = []
    for run_id in homes.run_ids(elastic_url, storage_options):
        home = homes.Home(elastic_url, run_id, storage_options)
        record = home.lease_record()
        lease = None if record is None else {
            **{k: record.get(k) for k in ("host", "pid", "started", "expires", "released")},
            "live": leases.live(record)}
        rows.append({"run_id": run_id, "state": home.state(), "last_commit": home.last_commit(), "lease": lease,
                     "finished": home.finished_at(), "failure": home.failure()})
    return rows


def _commit(commit: dict | None) -> str:
    if commit is None:
        return "none"
    return f"epoch {commit['epoch']}, batch {commit['batch']} at {leases.when(commit['written'])}"


def _lease(lease: dict | None) -> str:
    if lease is None:
        return "none"
    whose = f"host {lease['host']}, pid {lease['pid']}, started {leases.when(lease['started'])}"
    if lease.get("released"):
        return f"released ({whose})"
    return f"{'live' if lease['live'] else 'expired'} until {leases.when(lease['expires'])} ({whose})"


def print_runs(elastic_url: str, as_json: bool = False) -> int:
    rows = describe(elastic_url)
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'RUN':<24} {'STATE':<9} {'LAST COMMIT':<44} LEASE")
    for row in rows:
        print(f"{row['run_id']:<24} {row['state']:<9} {_commit(row['last_commit']):<44} {_lease(row['lease'])}")
    if not rows:
        print(f"(no runs under {elastic_url})")
    return 0
