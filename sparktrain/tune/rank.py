"""A trial on a rank: Optuna's ``Trial`` as the objective sees it, answered by the study on the driver.

``sparktrain.tune.optimize`` runs :func:`objective_on_rank` on every rank of a trial's gang. It
opens the trial's channel to the driver (``sparktrain.tune.server``), hands the user's objective a
:class:`RankTrial`, and turns what the objective did into what rank 0 returns to the driver: its
value, or that it was pruned. Every call that needs the study (a suggestion, a report, the pruning
decision, a user attribute, the trial's params) is one request and one answer on that channel, so
a value the driver holds is the same on every rank. Imports nothing of the driver side.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import secrets
import socket
import threading
import time
from typing import Any, Callable, Sequence

from ..errors import SparkTrainError
from ..seam import channel, protocol, session

#: Seconds a rank waits for the driver to answer one request (a should_prune may wait for rank 0's report).
ANSWER_TIMEOUT = 300.0
#: Seconds a rank whose trial's channel broke keeps trying to open it again.
RECONNECT_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class TrialAddress:
    """Where the ranks of one trial reach the study, and who they are to it (pickled into the trial's run)."""

    host: str
    port: int
    secret: bytes
    encrypted: bool
    number: int


@dataclasses.dataclass(frozen=True)
class Pruned:
    """Rank 0's return value when the objective raised ``optuna.TrialPruned``."""

    message: str


@dataclasses.dataclass(frozen=True)
class Finished:
    """Rank 0's return value when the objective returned ``value``."""

    value: Any


class StudyChannelError(SparkTrainError):
    """The study on the driver refused a request of this trial, or could not be reached."""


class _Study:
    """The rank's end of its trial's channel: one request at a time, each answered. Requests and
    answers are numbered (``sparktrain.seam.session``): where the connection breaks once it has
    worked, the rank reconnects with backoff for up to :data:`RECONNECT_SECONDS` and asks again,
    and the study answers a request it has answered already with the answer it gave, never twice."""

    def __init__(self, address: TrialAddress, rank: int):
        self._address, self._rank = address, rank
        self._token = secrets.token_hex(16)
        self._session = session.Session()
        self._lock = threading.Lock()
        self._channel: channel.Channel | None = None
        self._connect()

    def _connect(self) -> None:
        """A connection: the hello, the study's word that it took it, then every request unanswered."""
        a = self._address
        chan = channel.connect((a.host, a.port), a.secret, timeout=30.0, encrypted=a.encrypted)
        try:
            chan.sock.settimeout(30.0)
            hello = protocol.TrialHello(a.number, self._rank, session=self._token)
            chan.send_encoded(self._session.wrap(protocol.encode(hello), numbered=False))
            try:
                if self._read(chan) is not None:
                    raise protocol.ProtocolError("the study answered a hello")
            except socket.timeout:
                raise ConnectionError("the study did not take this trial's hello within 30 s") from None
            chan.sock.settimeout(ANSWER_TIMEOUT)
            for frame in self._session.unacknowledged(0):
                chan.send_encoded(frame)
        except BaseException:
            chan.close()
            raise
        self._channel = chan

    def _read(self, chan: channel.Channel) -> protocol.Answer | None:
        """The next frame: a new answer, or None for a frame that brings none."""
        body = chan.recv_body()
        if body is None:
            raise ConnectionError("the study closed this trial's channel")
        seq, ack, payload = session.split(body)
        msg = chan.decode(payload)
        fresh = self._session.take(seq, ack)
        return msg if fresh and isinstance(msg, protocol.Answer) else None

    def ask(self, request) -> Any:
        with self._lock:
            frame = self._session.wrap(protocol.encode(request))
            answer = self._exchange(frame, request)
        if answer.error is not None:
            raise StudyChannelError(answer.error)
        return json.loads(answer.value)

    def _exchange(self, frame: bytes, request) -> protocol.Answer:
        """Send ``frame`` and wait for its answer, reconnecting while the channel breaks."""
        until, tries = time.monotonic() + RECONNECT_SECONDS, 0
        while True:
            try:
                if self._channel is None:
                    self._connect()  # the request goes again with it
                else:
                    self._channel.send_encoded(frame)
                while True:
                    answer = self._read(self._channel)
                    if answer is not None:
                        return answer
            except socket.timeout:
                raise StudyChannelError(f"the study on the driver did not answer {request.TYPE!r} within "
                                        f"{ANSWER_TIMEOUT:g} s") from None
            except (OSError, channel.AuthenticationError, protocol.ProtocolError) as e:
                if self._channel is not None:
                    self._channel.close()
                    self._channel = None
                if time.monotonic() > until:
                    raise StudyChannelError(
                        f"this trial's channel to the study on the driver broke ({e}) and could not be opened again "
                        f"within {RECONNECT_SECONDS:g} s (the trial has ended, or the driver is gone)") from None
                time.sleep(session.BACKOFF[min(tries, len(session.BACKOFF) - 1)])
                tries += 1

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


def _trial_base():
    import optuna

    return optuna.trial.BaseTrial


class RankTrial(_trial_base()):
    """Optuna's ``Trial`` on a rank of a ``sparktrain.tune`` trial: suggestions come from the study's
    sampler on the driver (one value per name, the same on every rank), rank 0's reports are the
    ones the study records, and ``should_prune`` gives every rank the same answer for a step.

    >>> def objective(trial):                       # doctest: +SKIP
    ...     lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)   # the same lr on every rank
    ...     ...
    """

    def __init__(self, study: _Study, number: int):
        self._study = study
        self._number = number
        self._step = -1

    # -- suggestions -----------------------------------------------------------------------------------
    def _suggest(self, method: str, name: str, **args: Any) -> Any:
        return self._study.ask(protocol.Suggest(name, method, json.dumps(args)))

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float:
        return self._suggest("suggest_float", name, low=low, high=high, step=step, log=log)

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        return self._suggest("suggest_int", name, low=low, high=high, step=step, log=log)

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._suggest("suggest_categorical", name, choices=list(choices))

    def suggest_uniform(self, name: str, low: float, high: float) -> float:
        return self.suggest_float(name, low, high)

    def suggest_loguniform(self, name: str, low: float, high: float) -> float:
        return self.suggest_float(name, low, high, log=True)

    def suggest_discrete_uniform(self, name: str, low: float, high: float, q: float) -> float:
        return self.suggest_float(name, low, high, step=q)

    # -- reports and pruning ---------------------------------------------------------------------------
    def report(self, value: float, step: int) -> None:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"trial.report takes a float value; got {value!r} of type {type(value).__name__}") \
                from None
        if int(step) < 0:
            raise ValueError(f"trial.report takes a step >= 0; got {step!r}")
        self._step = int(step)
        self._study.ask(protocol.Report(int(step), value))

    def should_prune(self) -> bool:
        return bool(self._study.ask(protocol.ShouldPrune(self._step)))

    def set_user_attr(self, key: str, value: Any) -> None:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            raise TypeError(f"trial.set_user_attr({key!r}, ...) takes a JSON value, as Optuna's storages do; "
                            f"got {type(value).__name__}") from None
        self._study.ask(protocol.SetUserAttr(str(key), text))

    def set_constraint(self, key: str, value: float) -> None:
        raise NotImplementedError("trial.set_constraint is not served to the ranks; return the constraint in "
                                  "a user attribute and read it with the study's constraints_func")

    # -- what the trial holds --------------------------------------------------------------------------
    @property
    def number(self) -> int:
        return self._number

    @property
    def params(self) -> dict[str, Any]:
        return self._study.ask(protocol.Look("params"))

    @property
    def distributions(self) -> dict:
        import optuna

        found = self._study.ask(protocol.Look("distributions"))
        return {k: optuna.distributions.json_to_distribution(v) for k, v in found.items()}

    @property
    def user_attrs(self) -> dict[str, Any]:
        return self._study.ask(protocol.Look("user_attrs"))

    @property
    def datetime_start(self) -> datetime.datetime | None:
        found = self._study.ask(protocol.Look("datetime_start"))
        return None if found is None else datetime.datetime.fromisoformat(found)


def objective_on_rank(objective: Callable[[Any], Any], address: TrialAddress) -> Any:
    """What each rank of a trial runs: ``objective(trial)`` with a :class:`RankTrial`; rank 0 returns
    :class:`Finished` or :class:`Pruned` to the driver, other ranks None."""
    import optuna

    from .. import context

    rank = context.rank()
    study = _Study(address, rank)
    try:
        try:
            value = objective(RankTrial(study, address.number))
        except optuna.TrialPruned as e:
            return Pruned(str(e)) if rank == 0 else None
        return Finished(value) if rank == 0 else None
    finally:
        study.close()
