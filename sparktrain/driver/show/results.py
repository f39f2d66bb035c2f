"""What an attempt hands back and says at its end: rank 0's value (from Spark's bytes, or from
storage where rank 0 spilled it) and the words for where the ranks ran and how much came back."""
from __future__ import annotations

import logging
import os
import posixpath
from typing import Any, Mapping

from ...seam.spec import SPILLED

log = logging.getLogger("sparktrain")


def load_result(data: bytes | None) -> Any:
    """Rank 0's value from the bytes Spark carried, or from storage where rank 0 spilled it."""
    import cloudpickle

    if not data:
        return None
    if not data.startswith(SPILLED):
        return cloudpickle.loads(data)
    import tempfile

    from ... import storage

    url = data[len(SPILLED):].decode()
    log.info("sparktrain: rank 0's value was too large for spark.driver.maxResultSize; reading it from %s", url)
    try:
        with tempfile.TemporaryDirectory(prefix="sparktrain-result-") as tmp:
            local = storage.get_file(url, os.path.join(tmp, "value.pkl"))
            with open(local, "rb") as f:
                return cloudpickle.load(f)
    finally:
        try:
            fs, path = storage.filesystem(url)
            fs.rm(posixpath.dirname(path), recursive=True)
        except Exception as e:  # noqa: BLE001 - the value is safe; say what is left behind
            log.warning("sparktrain: could not delete the spilled result under %s: %s", url, e)


def placement(hosts: Mapping[int, str]) -> str:
    """``10.0.0.5 (ranks 0-1), 10.0.0.6 (rank 2)``: where the ranks run."""
    by_host: dict[str, list[int]] = {}
    for rank in sorted(hosts):
        by_host.setdefault(hosts[rank], []).append(rank)
    parts = []
    for host, ranks in by_host.items():
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        which = (f"rank {ranks[0]}" if len(ranks) == 1 else
                 f"ranks {ranks[0]}-{ranks[-1]}" if contiguous else "ranks " + ",".join(map(str, ranks)))
        parts.append(f"{host} ({which})")
    return ", ".join(parts)


def byte_size(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{n / 2**10:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"
