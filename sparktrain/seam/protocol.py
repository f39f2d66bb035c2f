"""The messages between the driver and its ranks, and their one encoding.

Pure and shared: the driver's server (``sparktrain.driver.supervise.server``) and each rank's task
(``sparktrain.executor``) import it; it imports neither. Every message is a frozen dataclass; :func:`encode`
turns one into the JSON object the channel (``sparktrain.seam.channel``) frames and signs, ``{"type":
<TYPE>, <field>: <value>, ...}`` (a field that is None is left out), and :func:`decode` turns such an
object back into its message, or raises :class:`ProtocolError` naming what is wrong. Nothing is ever unpickled.

A rank's task sends :class:`CheckedIn`, :class:`Output`, :class:`Beat`, :class:`Quiet`, :class:`Stacks`,
:class:`RankFailed`, :class:`Bye`, and :class:`Resume` first on a connection that replaces a broken
one; the driver sends :class:`Peers`, :class:`Beat`, :class:`AskStacks`, :class:`Abort`, and
:class:`Resumed` to a resume it takes. Each side decodes only what the other may send (numbered
across connections by ``sparktrain.seam.session``).

A rank of a ``sparktrain.tune`` trial also speaks to the study on its own channel to the driver:
it says which trial it serves (:class:`TrialHello`), then asks (:class:`Suggest`, :class:`Report`,
:class:`ShouldPrune`, :class:`SetUserAttr`, :class:`Look`) and waits for each :class:`Answer`.
Values that Optuna takes as any JSON value travel as JSON text.

A rank's failure reaches the driver one way: the task's :class:`RankFailed` message. Where there is
no channel to carry it (ranks meet through Spark's barrier, or the channel broke and did not come
back), the same encoded message rides in the task's error (:class:`RankError`), and the driver reads
it back out of Spark's error text (:func:`failures_in`). Only a rank that could say nothing at all
(its task died) leaves the driver to read Spark's own error.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
from typing import Any, Callable, ClassVar, Iterable, Union

from ..errors import RankFailure, SparkTrainError


class ProtocolError(SparkTrainError, ValueError):
    """A message that is not one of the protocol's, or whose fields are missing or of the wrong type."""


# -- rank to driver ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckedIn:
    """A rank checks in: where it runs and the ports it holds for the ring, from the barrier task of
    ``partition`` (-1 in local mode), with its row count per fed DataFrame (``shard``).

    ``collective_key`` travels only through Spark's barrier (rank 0's, when there is no channel)."""

    TYPE: ClassVar[str] = "hello"
    rank: int
    host: str
    port: int
    master_port: int
    pid: int
    partition: int = -1
    shard: dict = dataclasses.field(default_factory=dict)
    collective_key: str | None = None
    #: A fresh random name for this rank's session, which a :class:`Resume` must name.
    session: str | None = None


@dataclasses.dataclass(frozen=True)
class Output:
    """One line the rank printed, on ``stream`` ("stdout" or "stderr"), at wall-clock ``time``."""

    TYPE: ClassVar[str] = "out"
    stream: str
    line: str
    time: float
    #: True: the line being drawn (a progress bar) as it stands now, not yet finished: the driver
    #: may show it in place; it reaches no log, tail or file. (None, left off the wire: finished.)
    live: bool | None = None
    #: A finished line that was redrawn in place before it was finished: a progress bar's last state.
    drawn: bool | None = None


@dataclasses.dataclass(frozen=True)
class Beat:
    """Both ways, every second while a rank runs. A rank's may carry ``at``, where its collectives
    stand (``sparktrain.engine.progress.read``)."""

    TYPE: ClassVar[str] = "beat"
    at: dict | None = None


@dataclasses.dataclass(frozen=True)
class Quiet:
    """The rank's process ended: no more beats (its result may take a while to go up)."""

    TYPE: ClassVar[str] = "quiet"


@dataclasses.dataclass(frozen=True)
class Stacks:
    """The rank's threads' Python stacks, as asked for (:class:`AskStacks`); "" when it could not answer."""

    TYPE: ClassVar[str] = "stacks"
    text: str


@dataclasses.dataclass(frozen=True)
class RankFailed:
    """The rank failed: the one report of it that reaches the driver."""

    TYPE: ClassVar[str] = "failed"
    failure: RankFailure


@dataclasses.dataclass(frozen=True)
class Bye:
    """The task is done with the channel: the connection's end that follows is no break."""

    TYPE: ClassVar[str] = "bye"


@dataclasses.dataclass(frozen=True)
class Resume:
    """The first message on a connection that replaces a broken one: the rank, the attempt, the
    session its hello named, and the seconds since the rank last heard from the driver (``away``).
    Answered with :class:`Resumed`, or refused by a close."""

    TYPE: ClassVar[str] = "resume"
    rank: int
    attempt: int
    session: str
    away: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrialHello:
    """A rank of trial ``number`` opens its channel to the study, naming its ``session`` (the first
    message on each connection)."""

    TYPE: ClassVar[str] = "trial"
    number: int
    rank: int
    session: str | None = None


@dataclasses.dataclass(frozen=True)
class Suggest:
    """``trial.<method>(name, **args)`` on the driver's trial (``args``: JSON); answered with the value."""

    TYPE: ClassVar[str] = "suggest"
    name: str
    method: str
    args: str


@dataclasses.dataclass(frozen=True)
class Report:
    """``trial.report(value, step)``; the study records rank 0's only."""

    TYPE: ClassVar[str] = "report"
    step: int
    value: float


@dataclasses.dataclass(frozen=True)
class ShouldPrune:
    """Prune now? ``step``: this rank's last reported step (-1: none); every rank gets one answer per step."""

    TYPE: ClassVar[str] = "prune?"
    step: int


@dataclasses.dataclass(frozen=True)
class SetUserAttr:
    """``trial.set_user_attr(key, value)`` (``value``: JSON)."""

    TYPE: ClassVar[str] = "attr"
    key: str
    value: str


@dataclasses.dataclass(frozen=True)
class Look:
    """Read the driver's trial: ``what`` is "params", "distributions", "user_attrs" or "datetime_start"."""

    TYPE: ClassVar[str] = "look"
    what: str


# -- driver to rank ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Peers:
    """Every rank checked in: each one's host and ports and shard, in rank order (see :func:`peers`)."""

    TYPE: ClassVar[str] = "peers"
    hosts: tuple[str, ...]
    ports: tuple[int, ...]
    master_port: int
    shards: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class AskStacks:
    """Send your process's Python stacks (answered with :class:`Stacks`)."""

    TYPE: ClassVar[str] = "stacks"


@dataclasses.dataclass(frozen=True)
class Abort:
    """Stop your process now, or do not start it: ``reason`` says why."""

    TYPE: ClassVar[str] = "abort"
    reason: str


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The driver took a :class:`Resume`: the connection carries the rank's session on."""

    TYPE: ClassVar[str] = "resumed"


@dataclasses.dataclass(frozen=True)
class Answer:
    """The study's answer to a trial's request: ``value`` as JSON text, or the ``error`` it raised."""

    TYPE: ClassVar[str] = "answer"
    value: str = "null"
    error: str | None = None


TRIAL_REQUESTS = (Suggest, Report, ShouldPrune, SetUserAttr, Look)
FromRank = Union[CheckedIn, Output, Beat, Quiet, Stacks, RankFailed, Bye, Resume, TrialHello, Suggest, Report,
                 ShouldPrune, SetUserAttr, Look]
FromDriver = Union[Peers, Beat, AskStacks, Abort, Resumed, Answer]
Message = Union[FromRank, FromDriver]

#: Who sent a message: a rank's task or the driver.
RANK, DRIVER = "rank", "driver"


def peers(hellos: Iterable[Message]) -> Peers:
    """The answer to every rank's hello, from all of them (in any order)."""
    ordered = sorted(hellos, key=lambda h: getattr(h, "rank", -1))
    for h in ordered:
        if not isinstance(h, CheckedIn):
            raise ProtocolError(f"a rank sent a {h.TYPE!r} message where every rank says hello")
    return Peers(tuple(h.host for h in ordered), tuple(h.port for h in ordered), ordered[0].master_port,
                 tuple(h.shard for h in ordered))


# -- the encoding --------------------------------------------------------------------------------------

def _number(v: Any) -> float:
    if type(v) not in (float, int):
        raise TypeError("a number")
    return float(v)


def _failure(v: Any) -> RankFailure:
    if type(v) is not dict or type(v.get("rank")) is not int or type(v.get("host")) is not str \
            or type(v.get("local_rank")) is not int:
        raise TypeError("a failure report with an int rank, a str host and an int local_rank")
    return RankFailure.from_dict(v)


def _items(item: type, what: str) -> Callable[[Any], tuple]:
    def read(v: Any) -> tuple:
        if type(v) is not list or not all(type(x) is item for x in v):
            raise TypeError(f"a list of {what}")
        return tuple(v)
    return read


#: How JSON carries each annotation a message may use: the one type its value has (json.loads makes
#: exact types; a bool is not an int), or a reader that converts it and raises TypeError naming
#: what it needs.
_READ: dict[str, tuple[type, str] | Callable[[Any], Any]] = {
    "int": (int, "an int"),
    "bool | None": (bool, "a bool"),
    "str": (str, "a str"),
    "str | None": (str, "a str"),
    "dict": (dict, "an object"),
    "dict | None": (dict, "an object"),
    "float": _number,
    "tuple[str, ...]": _items(str, "str"),
    "tuple[int, ...]": _items(int, "int"),
    "tuple[dict, ...]": _items(dict, "objects"),
    "RankFailure": _failure,
}


@dataclasses.dataclass(frozen=True)
class _Kind:
    cls: type
    #: (name, read, required) per field, in order; read as in _READ.
    fields: tuple[tuple[str, Any, bool], ...]


def _kind(cls: type) -> _Kind:
    fields = []
    for f in dataclasses.fields(cls):
        if f.type not in _READ:
            raise TypeError(f"{cls.__name__}.{f.name}: the protocol cannot encode a {f.type}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fields.append((f.name, _READ[f.type], required))
    return _Kind(cls, tuple(fields))


_SENT_BY: dict[str, dict[str, _Kind]] = {
    RANK: {c.TYPE: _kind(c) for c in (CheckedIn, Output, Beat, Quiet, Stacks, RankFailed, Bye, Resume,
                                      TrialHello, *TRIAL_REQUESTS)},
    DRIVER: {c.TYPE: _kind(c) for c in (Peers, Beat, AskStacks, Abort, Resumed, Answer)},
}


def encode(msg: Message) -> bytes:
    """The message as the channel carries it: compact JSON, ``{"type": ..., field: value, ...}``."""
    if isinstance(msg, RankFailed):
        wire: dict[str, Any] = {"type": "failed", "failure": msg.failure.to_dict()}
    else:  # a dataclass's __dict__ holds its fields, in their order
        fields = msg.__dict__
        wire = {"type": msg.TYPE, **fields}
        if None in fields.values():
            wire = {k: v for k, v in wire.items() if v is not None}
    return json.dumps(wire, separators=(",", ":")).encode()


def decode(body: bytes | str, sender: str) -> Message:
    """The message ``sender`` (:data:`RANK` or :data:`DRIVER`) sent in ``body``; raises
    :class:`ProtocolError` for anything else. Fields the message does not know are ignored."""
    try:
        wire = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"a message from a {sender} is not JSON: {e}") from None
    kinds = _SENT_BY[sender]
    tag = wire.get("type") if isinstance(wire, dict) else None
    kind = kinds.get(tag) if isinstance(tag, str) else None
    if kind is None:
        what = f"type {str(tag)[:40]!r}" if isinstance(wire, dict) else f"a JSON {type(wire).__name__}"
        raise ProtocolError(f"a {sender} sent a message of {what}; a {sender} sends only "
                            f"{', '.join(sorted(kinds))}")
    values = {}
    for name, read, required in kind.fields:
        if name not in wire:
            if required:
                raise ProtocolError(f"a {sender}'s {kind.cls.TYPE!r} message lacks its field {name!r}")
            continue
        value = wire[name]
        try:
            if type(read) is tuple:
                if type(value) is not read[0]:
                    raise TypeError(read[1])
            else:
                value = read(value)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"a {sender}'s {kind.cls.TYPE!r} message has {name}={str(value)[:80]!r}; "
                                f"it must be {e}") from None
        values[name] = value
    return kind.cls(**values)


# -- a failure carried in a task's error -----------------------------------------------------------------

_MARK = "SPARKTRAIN-FAILURE:"
_CARRIED = re.compile(re.escape(_MARK) + r"([A-Za-z0-9+/=]+):END")


class RankError(SparkTrainError):
    """Raised in a task so Spark fails the stage.

    With ``carry_report``, the task's :class:`RankFailed` message rides in the error's text, encoded
    as on the channel: for a rank whose channel could not carry it (ranks meet through Spark's
    barrier, or the channel broke and did not come back). The driver reads it back with
    :func:`failures_in`.
    """

    def __init__(self, failure: RankFailure, carry_report: bool = True):
        self.failure = failure
        self.carry_report = carry_report
        text = f"sparktrain {failure.headline()}"
        if carry_report:
            text += f"\n{_MARK}{base64.b64encode(encode(RankFailed(failure))).decode()}:END"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.failure, self.carry_report))


def failures_in(text: str) -> list[RankFailure]:
    """The failures carried in an error's text (Spark wraps a task's error in its own), the first
    per rank; a carried message that does not decode is passed over."""
    found: dict[int, RankFailure] = {}
    for m in _CARRIED.finditer(text):
        try:
            msg = decode(base64.b64decode(m.group(1), validate=True), RANK)
        except (ProtocolError, binascii.Error):
            continue
        if isinstance(msg, RankFailed):
            found.setdefault(msg.failure.rank, msg.failure)
    return list(found.values())

