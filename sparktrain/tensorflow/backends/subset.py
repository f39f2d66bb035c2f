"""A process set's collectives (``process_sets``): each one ``tf.numpy_function`` calling
``hostops`` on the set's own communicator, eagerly, in ``tf.function`` and in TensorFlow 1
graphs, where the set's members agree on the order with a ``Sequencer`` of the set's own."""
from __future__ import annotations

from . import native, sequence


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


class Subset(native.Numpy):
    """The collectives of one process set, as ``Numpy``'s on the set's :class:`Channel`; ``size``
    is the set's, and ``broadcast``'s ``root_rank`` the root's index in the set."""

    def __init__(self, channel: Channel, size: int):
        self.on, self.size = channel, size

    def _comm(self):
        return self.on.comm()

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
