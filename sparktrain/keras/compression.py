"""Gradient compression, Horovod's ``Compression.none`` and ``Compression.fp16``.

``sparktrain.tensorflow.Compression`` is used where the TensorFlow side has it; this module's
own classes follow the same contract (``compress(tensor) -> (tensor, ctx)``,
``decompress(tensor, ctx) -> tensor``) for a TensorFlow side that does not.
"""
from __future__ import annotations

from ..errors import SparkTrainError

try:  # the TensorFlow side's, once it has one: one Compression in the whole package
    from ..tensorflow import Compression  # type: ignore[attr-defined]
except ImportError:
    class NoneCompressor:
        """Sends tensors as they are."""

        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class FP16Compressor:
        """Sends floating-point tensors as float16 and restores their dtype on arrival."""

        @staticmethod
        def compress(tensor):
            import tensorflow as tf

            dtype = tensor.dtype
            if dtype.is_floating and dtype != tf.float16:
                return tf.cast(tensor, tf.float16), dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            import tensorflow as tf

            return tensor if ctx is None else tf.cast(tensor, ctx)

    class Compression:  # type: ignore[no-redef]
        """The compressors: ``Compression.none`` and ``Compression.fp16``."""

        none = NoneCompressor
        fp16 = FP16Compressor


def check_compression(compression) -> None:
    """Refuse anything that is not a compressor, naming it."""
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise SparkTrainError(f"compression must be Compression.none or Compression.fp16 (an object with compress "
                              f"and decompress), got {compression!r}")
