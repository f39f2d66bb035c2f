"""The study's end of its trials' channels, on the driver: one listener for the whole study.

Every rank of a running trial connects (``sparktrain.tune.rank``), says which trial it serves, and
asks; one thread per connection answers from the trial Optuna's loop handed out
(:meth:`TrialServer.serve` while its gang runs). Suggestions go to the study's sampler once per
name (Optuna returns the value it already chose for a name the trial has); rank 0's reports are
recorded; a pruning decision is taken once per step, when rank 0 reports that step, and every rank
asking for that step gets it. The channel is the run's own framing and authentication
(``sparktrain.seam.channel``), with a secret of the study's, and its numbering
(``sparktrain.seam.session``): a rank whose connection broke comes back on a new one naming its
session, asks again what was not answered, and gets the answer already given to a request it asks
again, so no suggestion, report or decision is taken twice or lost.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterator

from ..driver.face import RankLink
from ..seam import channel, protocol, session

log = logging.getLogger("sparktrain")

#: Seconds a rank's should_prune waits for rank 0 to report the same step before the trial's last
#: report decides.
PRUNE_WAIT = 60.0
#: The trial methods a rank may call on the driver's trial.
SUGGESTIONS = frozenset({"suggest_float", "suggest_int", "suggest_categorical"})


class _Served:
    """One running trial, as its ranks see it: the Optuna trial and the decisions already taken."""

    def __init__(self, trial, on_report: Callable[[int, int, float], None],
                 on_params: Callable[[int, dict], None]):
        self.trial = trial
        self.on_report, self.on_params = on_report, on_params
        self.lock = threading.Condition()
        #: The pruning decision per step, taken when rank 0 reported that step.
        self.decisions: dict[int, bool] = {}
        self.ended = False
        #: Each rank's session with the study, by its rank and the session it names.
        self.links: dict[tuple[int, str], RankLink] = {}


class TrialServer:
    """Listens on ``host`` for the ranks of the study's running trials (see the module's doc)."""

    def __init__(self, host: str, encrypted: bool):
        self.secret = channel.new_secret()
        self.encrypted = encrypted
        self._trials: dict[int, _Served] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._closed = False
        self._connections: set[channel.Channel] = set()
        self._thread = threading.Thread(target=self._accept, name="sparktrain-tune-accept", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def serve(self, trial, on_report: Callable[[int, int, float], None],
              on_params: Callable[[int, dict], None] = lambda number, params: None) -> Iterator[None]:
        """The ranks of ``trial`` are answered inside the block; after it, refused. ``on_report``
        hears rank 0's reports, ``on_params`` the trial's params when a suggestion added one."""
        served = _Served(trial, on_report, on_params)
        with self._lock:
            self._trials[trial.number] = served
        try:
            yield
        finally:
            with self._lock:
                self._trials.pop(trial.number, None)
            with served.lock:
                served.ended = True
                served.lock.notify_all()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            connections = list(self._connections)
        for c in connections:
            c.close()

    # -- connections -----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(sock, peer), name="sparktrain-tune-trial",
                             daemon=True).start()

    def _connection(self, sock: socket.socket, peer) -> None:
        try:
            ch = channel.accept(sock, self.secret, self.encrypted)
        except (OSError, channel.AuthenticationError) as e:
            log.warning("sparktrain: tune: refused a connection from %s (%s)", peer, e)
            sock.close()
            return
        with self._lock:
            self._connections.add(ch)
        try:
            self._answer(ch)
        except (OSError, channel.AuthenticationError, protocol.ProtocolError) as e:
            if not self._closed and not ch.closed:
                log.warning("sparktrain: tune: a trial's channel from %s broke: %s", peer, e)
        finally:
            with self._lock:
                self._connections.discard(ch)
            ch.close()

    def _answer(self, ch: channel.Channel) -> None:
        ch.sock.settimeout(None)
        body = ch.recv_body()
        if body is None:
            return
        _, ack, payload = session.split(body)
        hello = ch.decode(payload)
        if not isinstance(hello, protocol.TrialHello):
            return
        with self._lock:
            served = self._trials.get(hello.number)
        link = self._link(served, hello, ch, ack)
        try:
            while True:
                body = ch.recv_body()
                if body is None:
                    return
                seq, ack, payload = session.split(body)
                request = ch.decode(payload)
                if not link.take(ch, seq, ack):
                    continue  # answered already: the answer went again with the new connection
                link.send(protocol.encode(self._answer_to(served, hello, request)))
        finally:
            link.detach(ch)

    @staticmethod
    def _link(served: _Served | None, hello: protocol.TrialHello, ch: channel.Channel, ack: int) -> RankLink:
        """The rank's session, carried on ``ch`` (a new one for a new session), its hello acknowledged."""
        key = (hello.rank, hello.session or "")
        with served.lock if served is not None else contextlib.nullcontext():
            link = served.links.get(key) if served is not None and hello.session else None
            if link is None:
                link = RankLink(hello.rank, ch, hello.session)
                if served is not None and hello.session:
                    served.links[key] = link
                link.send(_ACK, numbered=False)
            else:
                old = link.attach(ch, ack, protocol.Beat())
                if old is not None:
                    old.close()
        return link

    def _answer_to(self, served: _Served | None, hello: protocol.TrialHello, request) -> protocol.Answer:
        if served is None or served.ended:
            return protocol.Answer(error=f"trial {hello.number} is not running on this study's driver")
        try:
            value = self._handle(served, hello.rank, request)
        except Exception as e:  # noqa: BLE001 - the rank raises it, as Optuna would have
            return protocol.Answer(error=f"{type(e).__name__}: {e}")
        return protocol.Answer(json.dumps(value))

    # -- requests --------------------------------------------------------------------------------------
    def _handle(self, served: _Served, rank: int, request) -> Any:
        trial = served.trial
        if isinstance(request, protocol.Suggest):
            if request.method not in SUGGESTIONS:
                raise ValueError(f"{request.method!r} is not one of {sorted(SUGGESTIONS)}")
            with served.lock:  # two ranks asking one new name at once: the sampler is asked once
                known = request.name in trial.params
                value = getattr(trial, request.method)(request.name, **json.loads(request.args))
            if not known:
                served.on_params(trial.number, trial.params)
            return value
        if isinstance(request, protocol.Report):
            if rank != 0:
                return None  # Optuna records one report per step; the study's is rank 0's
            with served.lock:
                trial.report(request.value, request.step)
                served.decisions[request.step] = bool(trial.should_prune())
                served.lock.notify_all()
            served.on_report(trial.number, request.step, request.value)
            return None
        if isinstance(request, protocol.ShouldPrune):
            return self._should_prune(served, rank, request.step)
        if isinstance(request, protocol.SetUserAttr):
            with served.lock:
                trial.set_user_attr(request.key, json.loads(request.value))
            return None
        if isinstance(request, protocol.Look):
            return _look(trial, request.what)
        raise ValueError(f"a trial's rank sent a {request.TYPE!r} message, which asks nothing of the study")

    @staticmethod
    def _should_prune(served: _Served, rank: int, step: int) -> bool:
        with served.lock:
            if step < 0:  # this rank reported nothing: the study's last report decides
                return bool(served.trial.should_prune())
            deadline = time.monotonic() + PRUNE_WAIT
            while step not in served.decisions and not served.ended and rank != 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("sparktrain: tune: trial %d: rank %d asked whether to prune at step %d, which "
                                "rank 0 did not report within %.0f s; the last report decides",
                                served.trial.number, rank, step, PRUNE_WAIT)
                    break
                served.lock.wait(left)
            if step not in served.decisions:
                served.decisions[step] = bool(served.trial.should_prune())
            return served.decisions[step]


_ACK = protocol.encode(protocol.Beat())


def _look(trial, what: str) -> Any:
    if what == "params":
        return trial.params
    if what == "user_attrs":
        return trial.user_attrs
    if what == "datetime_start":
        return None if trial.datetime_start is None else trial.datetime_start.isoformat()
    if what == "distributions":
        import optuna

        return {k: optuna.distributions.distribution_to_json(d) for k, d in trial.distributions.items()}
    raise ValueError(f"a rank asked for the trial's {what!r}; it may ask for params, distributions, user_attrs "
                     "or datetime_start")
