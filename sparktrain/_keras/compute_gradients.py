"""tf_keras' (Keras 2) distributed optimizer: the gradients reduced where tf_keras computes them, for
``tf.keras.optimizers.*`` and ``tf.keras.optimizers.legacy.*`` under ``TF_USE_LEGACY_KERAS=1``.

The distributed optimizer is a subclass of the user's tf_keras class, built from its config (so it
keeps its name and loads without sparktrain), whose gradients are reduced over the ranks where
tf_keras computes them: ``compute_gradients`` (``_compute_gradients`` and ``get_gradients`` on the
legacy optimizers). That is what ``model.fit``'s train step calls through ``minimize``, and what a
``LossScaleOptimizer`` calls on its inner optimizer, between scaling the loss and unscaling the
gradients; so the loss scale's overflow check reads the reduced gradients, which are the same on
every rank, and every rank skips an overflowing step together. Clipping (``clipnorm``,
``clipvalue``, ``global_clipnorm``) and weight decay happen in ``apply_gradients``, after the
reduction, as with Horovod.

With ``backward_passes_per_step`` N the gradients are summed into local accumulators for N passes
(no collective runs); the Nth pass reduces the sum (divided by N with
``average_aggregated_gradients``) and applies it. On the other passes ``apply_gradients`` only adds
one to ``optimizer.iterations``, which so counts passes, as it did under Horovod's Keras 2 wrapper.
"""
from __future__ import annotations

import dataclasses

from ..errors import InvalidArgumentError
from .reduction import GradientReduction, distributed_namespace, reduce_gradients, reduction_of

_classes: dict[type, type] = {}


def _tf():
    import tensorflow as tf

    return tf


def distributed_class(base: type) -> type:
    """The distributed subclass of the tf_keras optimizer class ``base`` (one per class)."""
    import tf_keras

    cls = _classes.get(base)
    if cls is None:
        legacy = issubclass(base, tf_keras.optimizers.legacy.Optimizer)
        hooks = {"_compute_gradients": _legacy_compute_gradients, "get_gradients": _legacy_get_gradients} if legacy \
            else {"compute_gradients": _compute_gradients, "_compute_gradients": _current_compute_gradients}
        cls = type(base.__name__, (base,), distributed_namespace(
            base, **hooks, apply_gradients=_apply_gradients, _agg_helper=property(_aggregation), _sparktrain_base=base))
        _classes[base] = cls
    return cls


def configured(config: dict, backward_passes_per_step: int) -> dict:
    """The distributed optimizer's config: tf_keras has no accumulation of its own (see ``_accumulated``)."""
    return config


def rewrap_loss_scale(optimizer, distribute, name: str | None):
    """``optimizer`` (a LossScaleOptimizer) rebuilt around its inner optimizer as ``distribute(inner,
    name)`` makes it, with its scale: its overflow check reads the reduced gradients, the same on every
    rank; one whose inner optimizer is distributed already comes back as it is."""
    import tf_keras

    if getattr(type(optimizer.inner_optimizer), "_sparktrain_distributed", False):
        return optimizer  # its inner optimizer reduces already: the scale reads the reduced gradients
    kwargs = dict(dynamic=optimizer.dynamic, initial_scale=optimizer.initial_scale)
    if optimizer.dynamic:
        kwargs["dynamic_growth_steps"] = optimizer.dynamic_growth_steps
    return tf_keras.mixed_precision.LossScaleOptimizer(distribute(optimizer.inner_optimizer, name), **kwargs)


def _compute_gradients(self, loss, var_list, tape=None):
    pairs = type(self)._sparktrain_base.compute_gradients(self, loss, var_list, tape)
    return _reduced_pairs(self, pairs)


def _current_compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
    # Horovod's wrapper gave every optimizer the legacy name and signature, and Keras 2 code calls it
    # (Horovod's own tests do); tf_keras' current optimizers have no grad_loss.
    if grad_loss is not None:
        raise InvalidArgumentError("grad_loss is not supported by tf_keras' current optimizers (it is by "
                                   "tf.keras.optimizers.legacy.*): leave it None, or use a legacy optimizer")
    return self.compute_gradients(loss, var_list, tape)


def _legacy_compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
    pairs = type(self)._sparktrain_base._compute_gradients(self, loss, var_list, grad_loss=grad_loss, tape=tape)
    return _reduced_pairs(self, pairs)


def _legacy_get_gradients(self, loss, params):
    # The TensorFlow 1 graph path of the legacy optimizers (model.fit in a tf.compat.v1 graph).
    grads = type(self)._sparktrain_base.get_gradients(self, loss, params)
    return _reduced(self, list(grads), list(params))


def _reduced_pairs(self, pairs) -> list:
    pairs = list(pairs)
    variables = [v for _, v in pairs]
    return list(zip(_reduced(self, [g for g, _ in pairs], variables), variables))


def _reduced(self, grads: list, variables: list) -> list:
    reduction = reduction_of(self)
    if reduction.backward_passes_per_step == 1:
        return reduce_gradients(grads, variables, reduction)
    return _accumulated(self, grads, variables, reduction)


class _Passes:
    """The local sums of the passes between two updates, and the pass counter. A plain object, so
    that neither tf_keras' tracking nor a saved model sees these variables."""

    def __init__(self, grads: list):
        tf = _tf()
        with tf.init_scope():
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="sparktrain_passes")
            self.sums = [tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False, name="sparktrain_grad_sum")
                         for g in grads]


def _passes(self, grads: list | None = None) -> _Passes | None:
    passes = self.__dict__.get("_sparktrain_passes")
    if passes is None and grads is not None:
        passes = _Passes(grads)
        self.__dict__["_sparktrain_passes"] = passes
    return passes


def _accumulated(self, grads: list, variables: list, reduction: GradientReduction) -> list:
    """Add this pass's gradients to the sums; on every Nth pass, the reduced sums (and the sums
    start again from 0), on the others zeros, which ``apply_gradients`` does not apply."""
    tf = _tf()
    present = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in present]  # sparse gradients are summed densely
    passes = _passes(self, dense)
    if len(passes.sums) != len(dense):
        raise InvalidArgumentError(f"backward_passes_per_step={reduction.backward_passes_per_step}: this step has "
                                   f"gradients for {len(dense)} variables where the first had {len(passes.sums)}; "
                                   "accumulate over one fixed set of trainable variables")
    for total, g in zip(passes.sums, dense):
        total.assign_add(g)
    n = reduction.backward_passes_per_step
    applying = tf.equal(passes.count.assign_add(1) % n, 0)
    once = dataclasses.replace(reduction, backward_passes_per_step=1)

    def reduce_now():
        sums = [s.read_value() for s in passes.sums]
        if reduction.average_aggregated_gradients:
            sums = [s / tf.cast(n, s.dtype) for s in sums]
        out = reduce_gradients(sums, [variables[i] for i in present], once)
        with tf.control_dependencies(out):
            resets = [s.assign(tf.zeros_like(s)) for s in passes.sums]
        with tf.control_dependencies(resets):
            return [tf.identity(g) for g in out]

    def keep():
        return [tf.zeros_like(s) for s in passes.sums]

    reduced = tf.cond(applying, reduce_now, keep) if present else []
    out = [None] * len(grads)
    for i, g in zip(present, reduced):
        out[i] = g
    return out


class _Aggregation:
    """What Horovod's Keras 2 wrapper showed of its local aggregation as ``optimizer._agg_helper``,
    which Keras 2 code and Horovod's tests read: ``counter``, the passes since the last update."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def counter(self):
        tf = _tf()
        passes = _passes(self._optimizer)
        n = reduction_of(self._optimizer).backward_passes_per_step
        return tf.constant(0, tf.int64) if passes is None else passes.count % n


def _aggregation(self) -> _Aggregation | None:
    """``_agg_helper``: None without local aggregation (``backward_passes_per_step=1``), as in Horovod."""
    return None if reduction_of(self).backward_passes_per_step == 1 else _Aggregation(self)


def _apply_gradients(self, grads_and_vars, *args, **kwargs):
    base = type(self)._sparktrain_base
    passes = _passes(self)
    if passes is None or reduction_of(self).backward_passes_per_step == 1:
        return base.apply_gradients(self, grads_and_vars, *args, **kwargs)
    tf = _tf()
    pairs = list(grads_and_vars)

    def apply():
        base.apply_gradients(self, pairs, *args, **kwargs)
        return tf.constant(True)

    def count_the_pass():
        self.iterations.assign_add(1)
        return tf.constant(False)

    return tf.cond(tf.equal(passes.count % reduction_of(self).backward_passes_per_step, 0), apply, count_the_pass)
