"""The GPUs a rank sees: Spark's GPU addresses for its task, as ``CUDA_VISIBLE_DEVICES``."""
from __future__ import annotations

from typing import Sequence

#: What ``CUDA_VISIBLE_DEVICES`` is set to when a rank must see no GPU.
NO_GPU = "-1"


def translate_gpu_ids(addresses: Sequence[str], visible: str | None) -> str:
    """Map the GPU addresses Spark assigned to a task onto ``CUDA_VISIBLE_DEVICES``.

    Spark's addresses are indices into the devices the executor can see. When the executor
    itself already runs under a ``CUDA_VISIBLE_DEVICES`` mask, address ``i`` means the
    ``i``-th entry of that mask. An empty ``addresses`` hides every GPU.

    >>> translate_gpu_ids(["1"], "4,5,6")
    '5'
    >>> translate_gpu_ids(["0"], None)
    '0'
    """
    if not addresses:
        return NO_GPU
    if visible is None or visible.strip() == "":
        return ",".join(str(a).strip() for a in addresses)
    mask = [v.strip() for v in visible.split(",") if v.strip()]
    out = []
    for a in addresses:
        try:
            out.append(mask[int(a)])
        except (ValueError, IndexError):
            raise ValueError(
                f"Spark assigned GPU address {a!r}, but the executor's CUDA_VISIBLE_DEVICES={visible!r} "
                f"has only {len(mask)} entries; make the discovery script report indices into that mask"
            ) from None
    return ",".join(out)
