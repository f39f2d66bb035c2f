"""Horovod's process sets: collectives over some of the ranks.

``ProcessSet(ranks)`` names the ranks; ``add_process_set`` (or ``init(process_sets=[...])``)
registers it on every rank, which gives it an id and, on its members, a communicator of the
native engine of its own: the members' hosts, in rank order, share memory within a host and
join a TCP ring across hosts, as the global communicator does. Every rank, member or not, adds
and removes the same sets in the same order, as in Horovod: adding one is a collective of every
rank (an allgather of the ports the members listen on, which also checks that the ranks agree).

A collective given ``process_set=`` runs over the set's members only, through one
``tf.numpy_function`` per call on the set's communicator (``backends.subset``); its ``size`` is
the set's, ``broadcast``'s ``root_rank`` is a global rank that must be in the set, and a rank
outside the set gets an error naming it. ``remove_process_set`` and ``shutdown()`` close the
set's communicator. Process sets need the native engine: TensorFlow's ring (GPUs, or
``SPARKTRAIN_CPU_COLLECTIVES=tensorflow``) runs every collective over all ranks.
"""
from __future__ import annotations

import numbers
import socket
import threading
import zlib

from . import runtime
from .backends.subset import Channel, Subset
from .runtime import require_init, state
from ..errors import InvalidArgumentError, UnsupportedError


class ProcessSet:
    """Some of the ranks, which run collectives together once registered (``add_process_set`` or
    ``init(process_sets=[...])``). ``ranks`` are kept sorted; ``process_set_id`` is None until
    the set is registered (and again once it is removed)."""

    process_set_id = None
    ranks = None

    def __init__(self, ranks):
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise InvalidArgumentError(f"ProcessSet takes a list of ranks (ints), got {ranks!r}")
        ranks = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0 for r in ranks):
            raise InvalidArgumentError(f"ProcessSet takes a list of ranks (ints >= 0), got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(f"ProcessSet({ranks!r}) names a rank twice; name each rank once")
        self.ranks = sorted(int(r) for r in ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self):
        """The number of ranks in the set, or None while it is not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This rank's index in the set (its place in ``ranks``), or None while the set is not
        registered; an error on a rank outside the set. Collectives still take global ranks
        (``broadcast``'s ``root_rank``), as in Horovod."""
        if self.process_set_id is None:
            return None
        me = runtime.rank()
        if me not in self.ranks:
            raise InvalidArgumentError(f"rank {me} is not part of {self}; ask included() first")
        return self.ranks.index(me)

    def included(self):
        """Whether this rank is in the set (None for a set without ranks)."""
        return None if self.ranks is None else runtime.rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank; id 0, always registered."""

    process_set_id = 0

    def __init__(self):
        pass

    @property
    def ranks(self):
        return list(range(runtime.size()))

    def _invalidate(self) -> None:
        pass

    def size(self) -> int:
        return runtime.size()

    def rank(self) -> int:
        return runtime.rank()

    def included(self) -> bool:
        return True


global_process_set = _GlobalProcessSet()


class Group:
    """What a collective needs of its process set: its ``backend`` (None: the global one, which
    ``collectives`` chooses), its ``size``, this rank's index in it, and its global ``ranks``."""

    def __init__(self, size: int, rank: int, ranks=None, backend=None):
        self.size, self.rank, self.ranks, self.backend = size, rank, ranks, backend

    def root(self, root_rank) -> int:
        """The set's index of the global ``root_rank``, checked."""
        members = self.ranks if self.ranks is not None else range(self.size)
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in members:
            if self.ranks is None:
                raise InvalidArgumentError(f"root_rank must be a rank in 0..{self.size - 1}, got {root_rank!r}")
            raise InvalidArgumentError(f"root_rank must be a (global) rank of the process set, one of {self.ranks}; "
                                       f"got {root_rank!r}")
        return root_rank if self.ranks is None else self.ranks.index(root_rank)


class _Registered:
    def __init__(self, ps: ProcessSet, ranks: tuple, channel: Channel | None, backend):
        self.ps, self.ranks, self.channel, self.backend = ps, ranks, channel, backend


_lock = threading.RLock()
_sets: dict[int, _Registered] = {}
_free_ids: list[int] = []
_next = {"id": 1, "made": 0}  # the next new id; how many sets this process made (names their segments)


def group(process_set) -> Group:
    """The :class:`Group` a collective given ``process_set`` runs on; an error naming the fix for
    a set that is not registered, or that this rank is not in."""
    if process_set is None or process_set is global_process_set:
        return Group(state.size, state.rank)
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"process_set must be a sparktrain.tensorflow.ProcessSet (or global_process_set), "
                                   f"got {process_set!r}")
    if process_set.process_set_id == 0:
        return Group(state.size, state.rank)
    entry = _sets.get(process_set.process_set_id)
    if entry is None or list(entry.ranks) != process_set.ranks:
        raise InvalidArgumentError(f"{process_set} is not registered; add it on every rank first "
                                   "(hvd.add_process_set, or hvd.init(process_sets=[...]))")
    if state.rank not in entry.ranks:
        raise InvalidArgumentError(f"rank {state.rank} is not a member of {process_set}; run its collectives on its "
                                   "ranks only (if process_set.included(): ...)")
    return Group(len(entry.ranks), entry.ranks.index(state.rank), list(entry.ranks), entry.backend)


def add_process_set(process_set) -> ProcessSet:
    """Register ``process_set`` (a :class:`ProcessSet` or a list of ranks) and return it with its
    id. Every rank calls it, with the same ranks, in the same order as its other process-set calls;
    a set with the ranks of a registered one (or of every rank) is refused."""
    require_init()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    with _lock:
        _register(ps)
    return ps


def remove_process_set(process_set) -> bool:
    """Unregister ``process_set`` and close its communicator; True if it was registered. Every
    rank calls it, in the same order. The global set is never removed (False), as in Horovod."""
    require_init()
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"remove_process_set takes a ProcessSet, got {process_set!r}")
    if process_set.process_set_id in (None, 0):
        return False
    with _lock:
        entry = _sets.get(process_set.process_set_id)
        if entry is None or list(entry.ranks) != process_set.ranks:
            return False
        del _sets[process_set.process_set_id]
        _free_ids.append(process_set.process_set_id)
        process_set._invalidate()
        if entry.channel is not None:
            entry.channel.close()
    return True


def _register(ps: ProcessSet) -> None:
    ranks = tuple(ps.ranks)
    if state.size == 1 or state.comm is None:
        if state.size > 1:
            where = "NCCL (GPUs)" if state.gpu else "TensorFlow's ring (SPARKTRAIN_CPU_COLLECTIVES=tensorflow)"
            raise UnsupportedError(
                f"{ps}: process sets other than global_process_set run on sparktrain's native CPU engine, and this "
                f"rank runs its collectives on {where}, over every rank. Leave SPARKTRAIN_CPU_COLLECTIVES "
                "(spark.sparktrain.cpuCollectives) at native on CPU, or run the collectives over global_process_set")
        raise InvalidArgumentError(_refusal(ps, ranks) or f"{ps}: this run has one rank, global_process_set's")
    pid = _free_ids.pop(0) if _free_ids else _next["id"]
    try:
        channel = _connect(pid, ranks, _refusal(ps, ranks))
    except BaseException:
        if pid != _next["id"]:
            _free_ids.insert(0, pid)
        raise
    if pid == _next["id"]:
        _next["id"] += 1
    backend = None if channel is None else (Subset(channel, len(ranks)) if len(ranks) > 1 else _single())
    _sets[pid] = _Registered(ps, ranks, channel, backend)
    ps.process_set_id = pid


def _refusal(ps: ProcessSet, ranks: tuple) -> str:
    """Why this rank refuses to add ``ps`` (a duplicate, ranks out of range), or ""."""
    if isinstance(ps, _GlobalProcessSet) or ranks == tuple(range(state.size)):
        return (f"Attempted to add a duplicate process set: {ps} has every rank, as global_process_set (id 0) does; "
                "use global_process_set")
    if not ranks or ranks[-1] >= state.size:
        return f"{ps}: a process set holds one or more of the ranks 0..{state.size - 1}"
    for pid, entry in _sets.items():
        if entry.ranks == ranks:
            return f"Attempted to add a duplicate process set: {ps} has the ranks of process set {pid}; use that one"
    return ""


def _single():
    from . import backends

    return backends.get("single")


def _connect(pid: int, ranks: tuple, refusal: str):
    """The set's communicator on a member (a :class:`Channel`), None on other ranks. Every rank
    takes part: the members' ports, every rank's view of the set and any rank's ``refusal`` go
    round the global communicator first, so that every rank adds the set or every rank raises."""
    import numpy as np

    from .. import engine
    from ..engine.topology import layout

    c = engine.contract(state.timeout)
    member = state.rank in ranks and not refusal
    hosts = [c["hosts"][r] for r in ranks] if member else []
    me = ranks.index(state.rank) if member else -1
    listener = None
    if member and len(ranks) > 1:
        nodes, locals_ = layout(hosts, c["force_tcp"])
        if max(nodes) > 0 and locals_[me] == 0:  # this rank joins the set's ring between hosts
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((hosts[me], 0))
            listener.listen(8)
    try:
        port = listener.getsockname()[1] if listener is not None else 0
        view = [zlib.crc32(repr(ranks).encode()), pid, _next["made"]]
        every = state.comm.allgather(np.array([[port, int(bool(refusal))] + view], np.int64))
        refused = [r for r in range(state.size) if every[r, 1]]
        if refused:
            raise InvalidArgumentError(refusal or f"add_process_set({list(ranks)}): ranks {refused} refused the "
                                       "process set they were given (a duplicate there, or ranks out of range)")
        differ = [r for r in range(state.size) if every[r, 2:].tolist() != view]
        if differ:
            raise InvalidArgumentError(
                f"add_process_set({list(ranks)}): ranks {differ} added a different process set here (or their "
                "process sets in another order); every rank adds and removes the same sets in the same order")
        _next["made"] += 1
        if not member:
            return None
        name = f"{c['name']}-ps{pid}-{_next['made']}"
        communicator = None
        if len(ranks) > 1:
            communicator = engine.Communicator(me, len(ranks), hosts, [int(every[r, 0]) for r in ranks], c["secret"],
                                               name, timeout=state.timeout, force_tcp=c["force_tcp"], spin=c["spin"],
                                               listener=listener, encrypt=c["encrypt"])
        return Channel(pid, communicator, name, ranks)
    finally:
        if listener is not None:
            listener.close()  # the communicator closed it already, if it used it


def start(process_sets) -> None:
    """``init(process_sets=...)``: register each set of the list not registered yet, in order."""
    if process_sets is None or isinstance(process_sets, str):
        return
    for i, ps in enumerate(process_sets):
        if ps.process_set_id is None:
            try:
                add_process_set(ps)
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"init(process_sets=...): entry number {i}, {ps}: {e}") from None


def check(process_sets) -> None:
    """``init``'s ``process_sets``, checked before anything starts: None, ``"dynamic"`` (sets are
    added later, as they always may be) or a list of :class:`ProcessSet`."""
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        return
    if not isinstance(process_sets, (list, tuple)) or not all(isinstance(p, ProcessSet) for p in process_sets):
        raise InvalidArgumentError(f"init(process_sets={process_sets!r}): pass a list of "
                                   "sparktrain.tensorflow.ProcessSet (e.g. [hvd.ProcessSet([0, 2])]), or 'dynamic'")


def stop() -> None:
    """``shutdown()``: every set is unregistered (its ``process_set_id`` None again) and its
    communicator closed."""
    with _lock:
        for entry in _sets.values():
            entry.ps._invalidate()
            if entry.channel is not None:
                entry.channel.close()
        _sets.clear()
        _free_ids.clear()
        _next["id"] = 1


def size_op(process_set_id: int = 0, name: str | None = None):
    """The size of the process set ``process_set_id`` as an int32 tensor (default: every rank)."""
    return runtime._tf().identity(runtime._int_op(_registered_size(process_set_id, "size_op")), name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None):
    """1 if this rank is in the process set ``process_set_id``, else 0, as an int32 tensor."""
    _registered_size(process_set_id, "process_set_included_op")
    included = process_set_id == 0 or runtime.rank() in _sets[process_set_id].ranks
    return runtime._tf().identity(runtime._int_op(int(included)), name=name)


def _registered_size(process_set_id, what: str) -> int:
    if process_set_id == 0:
        return runtime.size()
    entry = _sets.get(process_set_id)
    if entry is None:
        raise InvalidArgumentError(f"{what}(process_set_id={process_set_id!r}): no such process set is registered; "
                                   f"registered: {[0] + sorted(_sets)}")
    return len(entry.ranks)


runtime.hooks.update(check=check, start=start, stop=stop)
