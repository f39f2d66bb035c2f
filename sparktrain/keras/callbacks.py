"""Horovod's Keras callbacks, on the Keras this process serves (``front``: Keras 3, or tf_keras
under ``TF_USE_LEGACY_KERAS=1``): broadcast and metric averaging here; the learning-rate schedule
and warm-up (``schedules``), the checkpoints (``checkpoints``), ``BackupAndRestore`` (``backup``) and
tracking (``tracking``) in rooms of their own, all importable from here as in Horovod."""
from __future__ import annotations

from ..errors import InvalidArgumentError, SparkTrainError
from .front import Callback, is_variable as _is_variable
from .on_jax import on_jax as _on_jax


def check_equal_steps(steps) -> None:
    """Fail fast, on every rank, when ranks would run different numbers of steps per epoch.

    A rank that runs out of batches early would leave the others waiting in a gradient
    collective until it times out. sparktrain raises instead of equalizing: silently dropping or
    repeating a rank's batches changes what is trained on.
    """
    known = -1 if steps is None else int(steps)
    if _on_jax():
        from .jax_engine import gather_ints

        everyone = gather_ints(known)
    else:
        import tensorflow as tf

        from ..tensorflow.collectives import allgather

        everyone = [int(s) for s in allgather(tf.constant([known], tf.int64)).numpy()]
    if len(set(everyone)) > 1:
        listing = ", ".join(f"rank {r}: {'unknown' if s < 0 else s}" for r, s in enumerate(everyone))
        good = [s for s in everyone if s >= 0]
        raise SparkTrainError(
            f"ranks have different numbers of steps per epoch ({listing}); they would wait for each other in "
            f"the gradient allreduce. Give every rank the same number of batches: shard with "
            f"x[rank::size] after dropping the remainder, or pass steps_per_epoch={min(good) if good else 'N'} "
            "to model.fit")


class BroadcastGlobalVariablesCallback(Callback):
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
        self._jax = _on_jax()
        self.device = device
        if local_variables is None:
            local_variables = []
        elif self._jax:
            raise InvalidArgumentError("local_variables: on JAX every variable is broadcast")
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        bad = [type(v).__name__ for v in local_variables if not _is_variable(v)]
        if bad:
            raise InvalidArgumentError(f"local_variables must be variables (keras.Variable or tf.Variable), got "
                                  f"{', '.join(bad)}; pass layer.weights for a whole layer")
        self._local_vars = {id(v): v for v in local_variables}
        self._done_first_batch = False

    def register_local_var(self, var) -> None:
        """Never broadcast ``var``: it stays each rank's own (TensorFlow backend only)."""
        if self._jax:
            raise InvalidArgumentError("register_local_var: on JAX every variable is broadcast")
        if not _is_variable(var):
            raise InvalidArgumentError(f"register_local_var takes a variable, got {type(var).__name__}")
        self._local_vars[id(var)] = var

    def _global(self, variables) -> list:
        from .._keras.reduction import local_variables

        local = set(self._local_vars)
        local.update(id(v) for v in local_variables(getattr(self.model, "optimizer", None)))
        return [v for v in variables if id(v) not in local]

    def on_train_begin(self, logs=None):
        if self._jax:
            from .jax_callbacks import broadcast_model

            check_equal_steps(self.params.get("steps") if self.params else None)
            broadcast_model(self.model, self.root_rank, with_optimizer=False)
            self._done_first_batch = False
            return
        from .._keras.update_step import agree_on_overflow
        from ..tensorflow.runtime import init

        init()
        check_equal_steps(self.params.get("steps") if self.params else None)
        agree_on_overflow(self.model)
        # A model given no input shape (Horovod's MNIST example builds one so) is built by its first
        # batch; tf_keras refuses to list its weights before. Its broadcast waits for that batch's end,
        # as Horovod's always did.
        if getattr(self.model, "built", True):
            _broadcast_variables(self._global(self.model.variables), self.root_rank)
        self._done_first_batch = False

    def on_train_batch_end(self, batch, logs=None):
        if self._done_first_batch:
            return
        self._done_first_batch = True
        if self._jax:
            from .jax_callbacks import broadcast_model

            broadcast_model(self.model, self.root_rank, with_optimizer=True)
            return
        _broadcast_variables(self._global(list(self.model.variables) + _optimizer_variables(self.model)),
                             self.root_rank)


def _broadcast_variables(variables: list, root_rank: int) -> None:
    from ..tensorflow.variables import broadcast_variables

    broadcast_variables(variables, root_rank)


def _optimizer_variables(model) -> list:
    """The model's optimizer's variables: a list on Keras 3, a method on tf_keras' legacy optimizers."""
    variables = model.optimizer.variables
    return list(variables() if callable(variables) else variables)


class MetricAverageCallback(Callback):
    """Replace each epoch's metrics with their average over all ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping), so they see the
    averaged values. Every rank must report the same metric names. ``device`` is accepted for
    Horovod's signature and ignored.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device
        self._jax = _on_jax()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        if self._jax:
            from .jax_callbacks import average_logs

            average_logs(logs)
            return
        import tensorflow as tf

        from ..tensorflow.collectives import allreduce
        from ..tensorflow.ops import Average

        names = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or hasattr(v, "dtype"))
        if not names:
            return
        values = allreduce(tf.constant([float(logs[k]) for k in names], tf.float64), op=Average)
        for k, v in zip(names, values.numpy().tolist()):
            logs[k] = v


# The other callbacks live in rooms of their own; Horovod users find them all here.
from .backup import BackupAndRestore  # noqa: E402,F401
from .checkpoints import BestModelCheckpoint, RemoteCheckpoint, save_checkpoint  # noqa: E402,F401
from .schedules import LearningRateScheduleCallback, LearningRateWarmupCallback  # noqa: E402,F401
from .tracking import MLflowLogger, RemoteTensorBoard  # noqa: E402,F401
