"""Reading where a rank's collectives stand, from outside the rank.

The native engine keeps a small record (``stc_progress`` in ``native/collective.h``) in the file
named by ``SPARKTRAIN_PROGRESS_FILE``: how many collectives the rank has begun, whether one is
running now, since when, and what it is (kind, dtype, shape). The rank's task reads it every
second and sends it to the driver with its beat, so the driver can tell which ranks wait in a
collective and which have not arrived (``sparktrain.driver.supervise.stalls``). Pure: no ctypes, no engine.
"""
from __future__ import annotations

import struct
import time

from .loader import DTYPES, OPS, _OPAQUE

MAGIC = 0x31475250434E5453
#: magic, version, begun, active, since_us; kind, dtype, arg, ndim; dims[8]
_RECORD = struct.Struct("=QQQQqIIiI8q")
KINDS = {1: "allreduce", 2: "broadcast", 3: "allgather", 4: "barrier", 5: "reducescatter", 6: "alltoall"}


def read(path: str, tries: int = 5) -> dict | None:
    """The rank's progress, or None when there is none (no file yet: no native communicator).

    ``{"n": collectives begun, "active": bool, "age": seconds the current one has run,
    "what": "allreduce", "dtype": "float32", "shape": [1024], "arg": "sum"}``; ``what`` and the
    rest describe the collective in progress, or the last one.
    """
    try:
        with open(path, "rb") as f:
            for _ in range(tries):  # a seqlock: keep a copy taken while no write was under way
                f.seek(0)
                raw = f.read(_RECORD.size)
                if len(raw) < _RECORD.size:
                    return None
                fields = _RECORD.unpack(raw)
                f.seek(8)
                after = struct.unpack("=Q", f.read(8))[0]
                if fields[0] == MAGIC and fields[1] % 2 == 0 and after == fields[1]:
                    return describe(fields)
    except OSError:
        return None
    return None


def describe(fields) -> dict:
    _, _, begun, active, since_us, kind, dtype, arg, ndim = fields[:9]
    dims = list(fields[9:9 + min(ndim, 8)])
    what = KINDS.get(kind, "?")
    info = {"n": begun, "active": bool(active), "age": max(0.0, time.time() - since_us / 1e6), "what": what,
            "dtype": DTYPES[dtype] if dtype < len(DTYPES) else f"opaque{(dtype - _OPAQUE) * 8}",
            "shape": dims if ndim <= 8 else dims[:7] + ["..."]}
    if what in ("allreduce", "reducescatter"):
        info["op"] = OPS[arg] if 0 <= arg < len(OPS) else str(arg)
    elif what == "broadcast":
        info["root"] = arg
    return info


def text(info: dict) -> str:
    """``allreduce #57 (float32[1024], sum)``: a collective as a stall report names it."""
    if info["what"] == "barrier":
        return f"barrier #{info['n']}"
    extra = f", {info['op']}" if "op" in info else f", root {info['root']}" if "root" in info else ""
    return f"{info['what']} #{info['n']} ({info['dtype']}[{','.join(map(str, info['shape']))}]{extra})"
