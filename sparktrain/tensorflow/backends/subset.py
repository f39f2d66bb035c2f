"""A process set's collectives (``process_sets``): each one ``tf.numpy_function`` calling
``hostops`` on the set's own communicator, eagerly, in ``tf.function`` and in TensorFlow 1
graphs, where the set's members agree on the order with a ``Sequencer`` of the set's own."""
from __future__ import annotations

from .. import hostops
from . import native, sequence
from .base import Backend, tf


class Channel:
    """A process set's communicator on this rank, with what orders its collectives in graphs.

    ``communicator`` is None once the set is removed (or ``shutdown()`` closed it): a function
    traced before then fails with an error naming why, rather than calling a closed engine."""

    def __init__(self, process_set_id: int, communicator, name: str = "", ranks=()):
        self.process_set_id, self.ranks = process_set_id, list(ranks)
        self.communicator = communicator
        self.name = name  # names the set's shared-memory segments (``engine.segment_name``)
        self.keys = sequence.Keys()
        self.sequencer = sequence.Sequencer()

    def comm(self):
        from ... import engine

        if self.communicator is None:
            raise engine.CollectiveError(
                f"process set {self.process_set_id} was removed (remove_process_set, or shutdown()); add it again "
                "with add_process_set and trace the function anew", engine.BROKEN)
        return self.communicator

    def close(self) -> None:
        communicator, self.communicator = self.communicator, None
        if communicator is not None:
            communicator.close()


class Subset(Backend):
    """The collectives of one process set, over its :class:`Channel`; ``size`` is the set's."""

    def __init__(self, channel: Channel, size: int):
        self.on, self.size = channel, size

    def _run(self, kind, fn, inputs, tout):
        on = self.on

        def within(*arrays):
            from ... import engine

            try:
                return fn(*arrays)
            except engine.CollectiveError as e:  # the engine numbers the set's ranks 0, 1, ...: say so
                raise engine.CollectiveError(f"process set {on.process_set_id} (global ranks {on.ranks}, numbered "
                                             f"0..{len(on.ranks) - 1} in it): {e}", e.code) from None

        return native._call(kind, within, inputs, tout, on=on)

    def allreduce(self, t, op, name=None):
        out = self._run(name or f"allreduce.{op}", lambda a: hostops.allreduce(self.on.comm(), a, op), [t], t.dtype)
        out.set_shape(t.shape)
        return out

    def grouped_allreduce(self, tensors, op):
        outs = self._run(f"grouped_allreduce.{op}",
                         lambda *arrays: hostops.grouped_allreduce(self.on.comm(), list(arrays), op),
                         tensors, [t.dtype for t in tensors])
        if not isinstance(outs, (list, tuple)):  # TensorFlow unwraps a list of one
            outs = [outs]
        for o, t in zip(outs, tensors):
            o.set_shape(t.shape)
        return list(outs)

    def allgather(self, t, name=None):
        out = self._run(name or "allgather", lambda a: hostops.allgather(self.on.comm(), a), [t], t.dtype)
        out.set_shape(native._rows_shape(t))
        return out

    def broadcast(self, t, root_rank, name=None):
        """``root_rank`` is the root's index in the set."""
        out = self._run(name or "broadcast", lambda a: hostops.broadcast(self.on.comm(), a, root_rank), [t], t.dtype)
        out.set_shape(t.shape)
        return out

    def reducescatter(self, t, op, name=None):
        out = self._run(name or f"reducescatter.{op}", lambda a: hostops.reducescatter(self.on.comm(), a, op), [t],
                        t.dtype)
        out.set_shape(native._rows_shape(t))
        return out

    def alltoall(self, t, splits):
        out, received = self._run("alltoall", lambda a, s: hostops.alltoall(self.on.comm(), a, s), [t, splits],
                                  [t.dtype, tf().int32])
        out.set_shape(native._rows_shape(t))
        received.set_shape([self.size])
        return out, received
