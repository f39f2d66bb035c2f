"""Horovod's Keras callbacks, written once: each an implementation that takes the front's
:class:`~sparktrain._keras.backend.Backend` (its Keras module and collectives), built into a class of
that Keras's ``Callback`` by ``backend.classes`` (``sparktrain.keras.callbacks`` builds them, once).
Broadcast and metric averaging here; the learning-rate schedule and warm-up (``schedules``), the
checkpoints (``checkpoints``), ``BackupAndRestore`` (``backup``), tracking (``tracking``) and the
elastic state's callbacks (``elastic``) in rooms of their own."""
from __future__ import annotations

from ..errors import InvalidArgumentError, SparkTrainError

def check_equal_steps(backend, steps) -> None:
    """Fail fast, on every rank, when ranks would run different numbers of steps per epoch.

    A rank that runs out of batches early would leave the others waiting in a gradient
    collective until it times out. sparktrain raises instead of equalizing: silently dropping or
    repeating a rank's batches changes what is trained on.
    """
    everyone = backend.gather_ints(-1 if steps is None else int(steps))
    if len(set(everyone)) > 1:
        listing = ", ".join(f"rank {r}: {'unknown' if s < 0 else s}" for r, s in enumerate(everyone))
        good = [s for s in everyone if s >= 0]
        raise SparkTrainError(
            f"ranks have different numbers of steps per epoch ({listing}); they would wait for each other in "
            f"the gradient allreduce. Give every rank the same number of batches: shard with "
            f"x[rank::size] after dropping the remainder, or pass steps_per_epoch={min(good) if good else 'N'} "
            "to model.fit")


class BroadcastGlobalVariablesCallbackImpl:
    """Make the model and optimizer state equal to ``root_rank``'s on every rank.

    The model's variables are broadcast before training starts, so every rank begins from the
    same weights even if they were initialized differently; after the first batch, the
    optimizer's state (created lazily by Keras) is broadcast too, and so are the weights of a
    model that had none before (built by that batch, for want of an input shape). At the start it also checks
    that every rank will run the same number of steps per epoch.

    Variables local to each rank are never broadcast: those in ``local_variables`` (a variable
    or a list), those given to :meth:`register_local_var`, and those the model's
    ``DistributedOptimizer`` keeps local (``register_local_var``, ``PartialDistributedOptimizer``'s
    ``local_layers``). ``device`` is accepted for Horovod's signature and ignored.

    Under a ``mixed_float16`` policy, the ``LossScaleOptimizer`` that ``model.compile`` put around
    a DistributedOptimizer is made to skip overflowing steps on every rank together (see
    ``DistributedOptimizer``).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        if local_variables is None:
            local_variables = []
        elif not self.backend.local_variables:
            raise InvalidArgumentError("local_variables: on JAX every variable is broadcast")
        elif self.backend.is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        bad = [type(v).__name__ for v in local_variables if not self.backend.is_variable(v)]
        if bad:
            raise InvalidArgumentError(f"local_variables must be variables (keras.Variable or tf.Variable), got "
                                       f"{', '.join(bad)}; pass layer.weights for a whole layer")
        self._local_vars = {id(v): v for v in local_variables}
        self._done_first_batch = False

    def register_local_var(self, var) -> None:
        """Never broadcast ``var``: it stays each rank's own (TensorFlow backend only)."""
        if not self.backend.local_variables:
            raise InvalidArgumentError("register_local_var: on JAX every variable is broadcast")
        if not self.backend.is_variable(var):
            raise InvalidArgumentError(f"register_local_var takes a variable, got {type(var).__name__}")
        self._local_vars[id(var)] = var

    def on_train_begin(self, logs=None):
        self.backend.prepare(self.model)
        check_equal_steps(self.backend, self.params.get("steps") if self.params else None)
        self.backend.broadcast_model(self.model, self.root_rank, False, self._local_vars)
        self._done_first_batch = False

    def on_train_batch_end(self, batch, logs=None):
        if self._done_first_batch:
            return
        self._done_first_batch = True
        self.backend.broadcast_model(self.model, self.root_rank, True, self._local_vars)


class MetricAverageCallbackImpl:
    """Replace each epoch's metrics with their average over all ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping), so they see the
    averaged values. Every rank must report the same metric names. ``device`` is accepted for
    Horovod's signature and ignored.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or hasattr(v, "dtype"))
        if not names:
            return
        for k, v in zip(names, self.backend.average_floats([float(logs[k]) for k in names])):
            logs[k] = v



IMPLS = [BroadcastGlobalVariablesCallbackImpl, MetricAverageCallbackImpl]
