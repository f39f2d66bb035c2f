"""What ragged collectives (allgather, alltoall) compare before they move data.

Every rank sends every other a small int64 vector, its *meta*: ``[ndim, dtype code, dims (padded
to 64), *extra]``. Each rank then reaches the same verdict from the same vectors, so a
disagreement is the same error on every rank and nobody waits for a rank that gave up.
"""
from __future__ import annotations

from .loader import DTYPES, CollectiveError, _MAX_DIMS, _OPAQUE, move_code


def meta_of(a, extra=()):
    """[ndim, dtype code, dims (padded to 64), *extra] of array ``a``."""
    import numpy as np

    meta = np.zeros(2 + _MAX_DIMS + len(extra), np.int64)
    meta[0], meta[1] = a.ndim, move_code(a.dtype)
    meta[2:2 + a.ndim] = a.shape
    meta[2 + _MAX_DIMS:] = extra
    return meta


def shape_text(meta_row) -> str:
    """``float32[3,4]``: the array a meta row describes."""
    ndim, code = int(meta_row[0]), int(meta_row[1])
    name = DTYPES[code] if 0 <= code < len(DTYPES) else f"opaque{(code - _OPAQUE) * 8}"
    return f"{name}[{','.join(str(int(d)) for d in meta_row[2:2 + ndim])}]"


def check_ragged(rank: int, what: str, metas) -> None:
    """The same verdict on every rank (each rank against rank 0): trailing dims and dtype agree."""
    for r in range(1, len(metas)):
        if metas[r, 0] != metas[0, 0] or metas[r, 1] != metas[0, 1] or \
                (metas[r, 3:2 + _MAX_DIMS] != metas[0, 3:2 + _MAX_DIMS]).any():
            differ = "dtypes" if metas[r, 1] != metas[0, 1] else "shapes"
            raise CollectiveError(
                f"rank {rank}: {what}: rank 0 passed {shape_text(metas[0])} but rank {r} passed "
                f"{shape_text(metas[r])}: the {differ} differ (only the first dimension may differ)")


def split_problem(a, splits, n: int) -> list[int]:
    """``[problem, how many splits were given, *splits]`` for an alltoall of ``a`` over ``n`` ranks;
    problem 0 when the splits are good, else the code :func:`splits_refused` words."""
    import numpy as np

    rows = a.shape[0] if a.ndim else 0
    problem, given = 0, np.zeros(n, np.int64)
    if a.ndim == 0:
        problem = 1
    elif splits is None:
        if rows % n:
            problem = 2
        else:
            given[:] = rows // n
    else:
        sp = np.asarray(splits).reshape(-1)
        if sp.size != n or (sp.size and not np.issubdtype(sp.dtype, np.integer)):
            problem = 3
        elif (sp < 0).any():
            problem, given[:] = 4, sp
        elif int(sp.sum()) != rows:
            problem, given[:] = 5, sp
        else:
            given[:] = sp
    return [problem, np.asarray(splits).size if splits is not None else n, *given]


def splits_refused(metas, n: int) -> str | None:
    """Why the first rank whose splits are bad cannot run the alltoall, or None when all are good."""
    for r in range(n):
        p = int(metas[r, 2 + _MAX_DIMS])
        if p:
            got = metas[r, 4 + _MAX_DIMS:].tolist()
            why = {1: "a scalar has no rows to send; pass an array of at least one dimension",
                   2: f"its {int(metas[r, 2])} rows do not split evenly over {n} ranks; pass splits",
                   3: f"splits must be {n} integers, one per rank (it passed {int(metas[r, 3 + _MAX_DIMS])} "
                      "values, or values that are not integers)",
                   4: f"splits {got} are negative",
                   5: f"splits {got} sum to {sum(got)}, not to its {int(metas[r, 2])} rows"}[p]
            return f"rank {r} passed {shape_text(metas[r])}: {why}"
    return None


def sent_rows(metas):
    """From the metas of an alltoall whose splits were all good: ``sent[i][j]``, the rows rank i sends rank j."""
    return metas[:, 4 + _MAX_DIMS:]
