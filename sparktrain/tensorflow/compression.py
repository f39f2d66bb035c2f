"""Gradient compression around a collective, as Horovod's ``Compression``.

A compressor has two static methods: ``compress(tensor) -> (compressed, ctx)`` and
``decompress(tensor, ctx) -> tensor``; the collective runs on the compressed tensor.
"""
from __future__ import annotations


class Compressor:
    """Interface: compress a tensor and return it with what its decompression needs."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor as it is (the default)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype; others as they are."""

    @staticmethod
    def compress(tensor):
        import tensorflow as tf

        if tensor.dtype.is_floating:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        import tensorflow as tf

        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class Compression:
    """The compressions: ``Compression.none`` (default) and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
