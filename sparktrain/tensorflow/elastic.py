"""Horovod's elastic API (``hvd.elastic``) on sparktrain: training state that outlives a failed attempt.

Horovod's elastic mode keeps the surviving workers running and re-syncs them when a host comes
or goes. A sparktrain run has a fixed gang: when a rank fails, ``run(..., max_attempts=N)``
starts every rank again. So here:

- ``state.commit()`` snapshots the state in memory (Horovod's ``save``) and, when the
  ``elastic_url`` setting is given (``SPARKTRAIN_ELASTIC_URL`` or ``spark.sparktrain.elasticUrl``),
  rank 0 writes it atomically to the run's home, ``<elastic_url>/<run id>/`` (``sparktrain.storage.home``);
- ``elastic.run(func)`` calls ``func(state, ...)`` after restoring the last committed state of
  this run (a later attempt finds what the failed one committed) and syncing every rank to rank
  0's state;
- without the setting, a run of one attempt keeps commits in memory, and ``state.restore()``
  goes back to the last commit, as in Horovod; a run of several attempts is refused, since its
  commits would be lost with the failed attempt's processes.

Example::

    import sparktrain.tensorflow as hvd          # or sparktrain.keras, with KerasState
    state = hvd.elastic.TensorFlowKerasState(model, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...one epoch...
            state.commit()

    train(state)

The state file is a pickle, read back only from the URL the run was given; point
``elastic_url`` only at storage you trust.
"""
from __future__ import annotations

import copy
import functools
import os
import pickle
from typing import Any, Callable

from .. import context as _ctx
from ..seam import worker_env
from ..storage import rank as rank_storage
from . import resize
from ..errors import HostsUpdatedInterrupt, InvalidArgumentError, SparkTrainError

_FORMAT = "sparktrain-elastic/1"


def _tfc():
    from .. import tensorflow

    return tensorflow


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``obj`` as it is on ``root_rank``, on every rank (``sparktrain.tensorflow.broadcast_object``)."""
    return _tfc().broadcast_object(obj, root_rank)


def state_url() -> str | None:
    """Where this run's committed state lives, or None when the ``elastic_url`` setting is not given."""
    home = rank_storage.home()
    return home.state_url() if home is not None else None


def _attempts_allowed() -> int:
    raw = os.environ.get(worker_env.MAX_ATTEMPTS, "1")
    try:
        return int(raw)
    except ValueError:
        raise SparkTrainError(f"{worker_env.MAX_ATTEMPTS}={raw!r} is not an integer; the sparktrain environment is "
                              "corrupted") from None


class State:
    """Horovod's ``State``: what a training function needs to continue after a failure.

    Subclasses say how to ``save`` (snapshot in memory), ``restore`` (go back to the snapshot),
    ``sync`` (make every rank equal to rank 0) and what to persist (``_payload`` /
    ``_load_payload``).
    """

    def __init__(self):
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called after the state is restored on a later attempt (Horovod: after a reset)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Snapshot the state; with the ``elastic_url`` setting, rank 0 also writes it there.

        Every rank calls it at the same points. The write is atomic: a later attempt finds this
        commit or the one before, never half of one.
        """
        self.save()
        home = rank_storage.home()
        if home is not None and _ctx.rank() == 0:
            home.commit(pickle.dumps({"format": _FORMAT, **self._payload()}), getattr(self, "epoch", None),
                        getattr(self, "batch", None))
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Under ``run_elastic``: when the driver wants a new size (free slots for more ranks, or an
        executor being decommissioned), every rank raises :class:`HostsUpdatedInterrupt` here,
        right after the commit, and the next attempt starts at that size from it
        (``sparktrain.tensorflow.resize``)."""
        why = resize.requested(look_now=True)
        if why:
            raise HostsUpdatedInterrupt(f"{why}: this attempt ends at its commit, and the next one starts from it")

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def _payload(self) -> dict:
        raise NotImplementedError

    def _load_payload(self, payload: dict) -> None:
        raise NotImplementedError

    def _restore_committed(self) -> bool:
        """Rank 0 loads this run's last committed state, if any, into the snapshot and the live
        objects; returns whether it found one (the same answer on every rank)."""
        home = rank_storage.home()
        found = False
        if home is not None and _ctx.rank() == 0:
            data = home.committed()
            payload = pickle.loads(data) if data is not None else None
            if payload is not None:
                if payload.get("format") != _FORMAT:
                    raise SparkTrainError(f"{home.state_url()} is not sparktrain elastic state (format "
                                          f"{payload.get('format')!r}); point elastic_url elsewhere")
                self._load_payload(payload)
                self.restore()
                found = True
        if _ctx.size() > 1:
            found = bool(broadcast_object(found))
        return found


class ObjectState(State):
    """Horovod's ``ObjectState``: keyword arguments become attributes that are saved, restored,
    synced and committed (they must pickle)."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs):
        super().__init__()
        self._bcast_object = bcast_object or broadcast_object
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state and _ctx.size() > 1:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _payload(self) -> dict:
        return {"attrs": self._saved_state}

    def _load_payload(self, payload: dict) -> None:
        attrs = payload.get("attrs", {})
        unknown = sorted(set(attrs) - set(self._saved_state))
        if unknown:
            raise SparkTrainError(f"the committed state has attributes {unknown} this state was not given; create "
                                  f"the state with the same keyword arguments ({sorted(attrs)})")
        self._saved_state.update(attrs)


def variable_values(variables) -> list:
    import numpy as np

    return [np.array(v.numpy()) for v in variables]


def assign_variables(variables, values, what: str) -> None:
    variables = list(variables)
    if len(variables) != len(values):
        raise SparkTrainError(f"the saved {what} has {len(values)} variables but this one has {len(variables)}; "
                              f"the state must be restored into the same {what}")
    for var, value in zip(variables, values):
        var.assign(value)


class TensorFlowKerasState(ObjectState):
    """Horovod's ``TensorFlowKerasState``: a Keras model, its optimizer, and attributes (``epoch=0``...).

    The model must be built. The optimizer (``model.optimizer`` unless given) is built on its
    model's trainable variables when the state syncs, so every rank has the same variables to
    receive. ``backend`` is accepted for Horovod's signature and ignored (TensorFlow 2).
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            raise InvalidArgumentError("the model must be built before its state is created: call model.build(input_shape) "
                                  "or run it on a batch first")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if self.optimizer is None:
            raise InvalidArgumentError("TensorFlowKerasState needs an optimizer: compile the model first or pass optimizer=")
        self.backend = backend
        self._save_model()
        super().__init__(**kwargs)

    def _build_optimizer(self) -> None:
        if hasattr(self.optimizer, "built") and not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def _optimizer_variables(self) -> list:
        variables = self.optimizer.variables
        return list(variables() if callable(variables) else variables)

    def _save_model(self) -> None:
        self._saved_model_state = variable_values(self.model.variables)
        self._saved_optimizer_state = variable_values(self._optimizer_variables())

    def _load_model(self) -> None:
        assign_variables(self.model.variables, self._saved_model_state, "model")
        if len(self._saved_optimizer_state) != len(self._optimizer_variables()):
            self._build_optimizer()  # Keras builds optimizers lazily; the saved one had been built
        assign_variables(self._optimizer_variables(), self._saved_optimizer_state, "optimizer")

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        tfc = _tfc()
        self._build_optimizer()
        if _ctx.size() > 1:
            tfc.broadcast_variables(self.model.variables, 0)
            tfc.broadcast_variables(self._optimizer_variables(), 0)
        self._save_model()
        super().sync()

    def _payload(self) -> dict:
        return {**super()._payload(), "model": self._saved_model_state, "optimizer": self._saved_optimizer_state}

    def _load_payload(self, payload: dict) -> None:
        super()._load_payload(payload)
        self._saved_model_state = payload["model"]
        self._saved_optimizer_state = payload["optimizer"]


class TensorFlowState(ObjectState):
    """Horovod's ``TensorFlowState``: a list of ``tf.Variable`` (or Keras variables) and attributes.

    TensorFlow 2 has no global variables, so ``variables`` is required; ``session`` is accepted
    for Horovod's signature and must be None.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise InvalidArgumentError("TensorFlowState needs variables= (TensorFlow 2 has no global variables to default "
                                  "to); pass model.variables or your tf.Variable list")
        if session is not None:
            raise InvalidArgumentError("TensorFlowState(session=...) is TensorFlow 1; leave session out")
        self.variables = list(variables)
        self._saved_variables = variable_values(self.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        self._saved_variables = variable_values(self.variables)
        super().save()

    def restore(self) -> None:
        assign_variables(self.variables, self._saved_variables, "variable list")
        super().restore()

    def sync(self) -> None:
        if _ctx.size() > 1:
            _tfc().broadcast_variables(self.variables, 0)
        self._saved_variables = variable_values(self.variables)
        super().sync()

    def _payload(self) -> dict:
        return {**super()._payload(), "variables": self._saved_variables}

    def _load_payload(self, payload: dict) -> None:
        super()._load_payload(payload)
        self._saved_variables = payload["variables"]


def run(func: Callable) -> Callable:
    """Horovod's ``hvd.elastic.run`` decorator: ``func(state, *args, **kwargs)`` after the state is
    restored from this run's last commit (on a later attempt) and synced from rank 0.

    Raises at the call, before any work, when the run has several attempts
    (``run(..., max_attempts=N)``) but no ``elastic_url`` setting: the commits would die with the
    failed attempt.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise InvalidArgumentError(f"an elastic.run function takes a State first (TensorFlowKerasState, KerasState, "
                                  f"TensorFlowState, ObjectState), got {type(state).__name__}")
        _tfc().init()
        attempts = _attempts_allowed()
        if state_url() is None and attempts != 1:  # 0: run_elastic without a reset_limit
            allowed = "no bound on its attempts" if attempts == 0 else f"max_attempts={attempts}"
            raise SparkTrainError(
                f"elastic.run: this run has {allowed} but no place to keep committed state, so a "
                f"later attempt could not resume from it. Set SPARKTRAIN_ELASTIC_URL (or the Spark conf "
                f"spark.sparktrain.elasticUrl) to an fsspec URL, e.g. run(..., env={{'SPARKTRAIN_ELASTIC_URL': "
                f"'abfss://container@account.dfs.core.windows.net/elastic'}}); or run with max_attempts=1 (commits "
                f"stay in memory); or save with callbacks.RemoteCheckpoint and resume with sparktrain.keras.restore()")
        resumed = state._restore_committed()
        state.sync()
        if resumed:
            state.on_reset()
        return func(state, *args, **kwargs)

    return wrapper
