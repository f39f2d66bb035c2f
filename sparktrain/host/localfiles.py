"""Local files that appear whole or not at all, and local files read in chunks.

Pure and shared: the rank process writes its result and error report this way, the driver its
downloaded checkpoints, and ``sparktrain.keras.save_model`` the user's model file.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def replaced_atomically(path: str) -> Iterator[str]:
    """Yield a temporary path beside ``path``; once the block succeeds, rename it to ``path``.

    A reader of ``path`` never sees half a file, and a failure leaves ``path`` as it was and no
    temporary file behind. The temporary name keeps ``path``'s extension, because some writers
    (Keras's ``model.save``) choose the format by it.

    >>> with replaced_atomically("/tmp/model.keras") as tmp:   # doctest: +SKIP
    ...     model.save(tmp)
    """
    base, ext = os.path.splitext(path)
    tmp = f"{base}.partial-{os.getpid()}-{os.urandom(4).hex()}{ext}"  # no uuid: the rank process imports this
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_atomically(path: str, data: bytes, *, durable: bool = False) -> None:
    """Write ``data`` to ``path`` whole or not at all; ``durable`` also flushes it to disk first."""
    with replaced_atomically(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())


def file_chunks(path: str, size: int) -> Iterator[bytes]:
    """The bytes of a local file, ``size`` at a time (memory does not grow with the file)."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(size)
            if not chunk:
                return
            yield chunk
