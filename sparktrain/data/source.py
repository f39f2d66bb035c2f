"""Which kind of shard a fed DataFrame is in this rank: spooled by its task, or read from its files."""
from __future__ import annotations

import functools
import os

from ..errors import SparkTrainError
from ..seam import worker_env
from ..storage import rank as rank_storage
from .shard import Shard, read_manifest
from .stream import StreamShard


@functools.lru_cache(maxsize=None)
def open_shard(name: str):
    """This rank's shard of the DataFrame fed as ``name`` (opened once per process): a :class:`Shard`
    its task spooled, or a ``stream.StreamShard`` it reads from the files of a scan."""
    directory = os.environ.get(worker_env.DATA_DIR)
    if not directory:
        raise SparkTrainError(
            "no DataFrame was fed to this process: sparktrain.data reads what sparktrain.run(..., data=df) "
            "feeds each rank, inside train_fn")
    manifest = read_manifest(directory, name)
    if name in manifest.get("scans", {}):
        return StreamShard(directory, name, manifest, rank_storage.options())
    return Shard(directory, name, manifest)
