"""Horovod's ``DistributedOptimizer`` and ``PartialDistributedOptimizer`` for Keras 3.

The distributed optimizer is a subclass of the user's optimizer class, built from its config,
whose gradients are reduced over all ranks inside the compiled train step, after Keras has
unscaled and (with ``backward_passes_per_step``) accumulated them, and before clipping and the
update, in every Keras release from 3.2 (see ``_backend_update_step``). Weight decay acts on the
variables, not the gradients, so its place does not change the result. Only the applying step reduces: on the other passes the gradients are
added to local accumulators (Keras 3's own ``gradient_accumulation_steps``) and no collective
runs.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ..errors import InvalidArgumentError
from .collectives import allreduce, global_process_set
from .compression import Compression
from .gradients import check_process_set, reduce_except_local
from .ops import Average, Min, Sum
from .runtime import size

_wrapped_classes: dict[type, type] = {}
#: The one LossScaleOptimizer subclass whose ranks agree on overflow (see _AgreeingLossScale).
_agreeing_loss_scale: list[type] = []


@dataclasses.dataclass
class GradientReduction:
    """How a distributed optimizer reduces its gradients (Horovod's arguments, checked)."""

    op: str = Average
    compression: Any = Compression.none
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    groups: Any = None
    scale_local_gradients: bool = True
    #: The ranks the gradients are reduced over (None: every rank).
    process_set: Any = None
    #: ``id()`` of each variable registered with ``register_local_var``, and the variables.
    local_vars: dict = dataclasses.field(default_factory=dict)
    local_layers: list = dataclasses.field(default_factory=list)

    def local_ids(self) -> set[int]:
        ids = set(self.local_vars)
        for layer in self.local_layers:
            ids.update(id(v) for v in layer.weights)
        return ids


def DistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "", device_sparse: str = "",  # noqa: N802
                         compression=Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: str = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                         process_set=global_process_set, scale_local_gradients: bool = True):
    """Wrap a Keras 3 optimizer so each update first reduces the gradients over all ranks.

    Horovod's arguments and defaults:

    - ``compression``: ``Compression.none`` or ``Compression.fp16`` (floating gradients travel
      as float16 and come back in their own dtype).
    - ``sparse_as_dense``: reduce ``tf.IndexedSlices`` gradients (embeddings) as dense tensors;
      by default they are gathered from every rank (values and indices) and stay sparse.
    - ``gradient_predivide_factor`` f: gradients are scaled by 1/f before the sum and by f/size
      after it (``op=Average`` only), to keep float16 sums in range.
    - ``op``: ``Average`` (default) or ``Sum``.
    - ``backward_passes_per_step`` N: gradients are accumulated locally for N passes, then
      reduced once and applied; ``average_aggregated_gradients=True`` divides the accumulated
      sum by N, as one pass over an N times larger batch would. ``optimizer.iterations`` counts
      the updates, as with Keras's ``gradient_accumulation_steps``, which this uses.
    - ``num_groups`` / ``groups``: how gradients are fused into collectives (a number of
      groups, or lists of variables reduced together); the result is the same.
    - ``scale_local_gradients``: gradients of variables registered with
      ``register_local_var`` are not reduced; with this they are divided by size, as Horovod
      does.
    - ``name``: the optimizer's name (Keras's ``name``); ``device_dense`` and
      ``device_sparse`` are accepted and ignored (sparktrain places collectives itself).
    - ``process_set``: the ranks the gradients are reduced over (a registered ``ProcessSet``);
      on a rank outside it they are applied unreduced, as Horovod does.

    A ``keras.optimizers.LossScaleOptimizer`` (mixed precision) is rebuilt around the
    distributed inner optimizer, with an overflow check every rank agrees on, so the ranks skip
    a step together. Pass it wrapped yourself under a ``mixed_float16`` policy:
    ``model.compile`` adds a plain one, whose ranks would decide alone.

    The result keeps the original class's name (``Adam``), so a saved model loads without
    sparktrain. An optimizer that is already distributed (from :func:`load_model`) comes back
    as it is. Clipping and weight decay happen after the reduction, as with Horovod.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer needs a Keras 3 optimizer (keras.optimizers.*), got {type(optimizer).__name__}; "
            "for tf_keras use sparktrain.tensorflow.strategy()")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if getattr(type(optimizer), "_sparktrain_distributed", False):
            return optimizer
        # The inner optimizer reduces; the loss-scale wrapper makes the ranks agree on skipping a step.
        inner = DistributedOptimizer(optimizer.inner_optimizer, None, device_dense, device_sparse, compression,
                                     sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
                                     average_aggregated_gradients, num_groups, groups, process_set,
                                     scale_local_gradients)
        return _AgreeingLossScale()(inner, initial_scale=optimizer.initial_scale,
                                    dynamic_growth_steps=optimizer.dynamic_growth_steps,
                                    name=name or optimizer.name)
    reduction = _check_arguments(optimizer, compression, sparse_as_dense, gradient_predivide_factor, op,
                                 backward_passes_per_step, average_aggregated_gradients, num_groups, groups,
                                 process_set, scale_local_gradients)
    base = type(optimizer)
    if getattr(base, "_sparktrain_distributed", False):
        # Already distributed (say, from load_model): reduced once per update, as it is.
        return optimizer
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped = _distributed_class(base).from_config(config)
    wrapped._sparktrain_reduction = reduction
    return wrapped


def PartialDistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "",  # noqa: N802
                                device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: str = Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients: bool = True):
    """A :func:`DistributedOptimizer` whose ``local_layers`` (a layer or a list) train on each rank's
    own gradients: their variables' gradients are never reduced.

    Pair it with ``BroadcastGlobalVariablesCallback(0, local_variables=...)`` or leave it to the
    callback, which skips every variable this optimizer treats as local. The layers may be
    unbuilt here; their weights are looked up when gradients are first applied.
    """
    import keras

    layers = [] if local_layers is None else [local_layers] if isinstance(local_layers, keras.layers.Layer) \
        else list(local_layers)
    bad = [type(layer).__name__ for layer in layers if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise InvalidArgumentError(f"local_layers must be Keras layers, got {', '.join(bad)}; pass model.layers[i] "
                              "or the layer objects themselves")
    wrapped = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                   compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                                   backward_passes_per_step=backward_passes_per_step,
                                   average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    wrapped._sparktrain_reduction.local_layers = layers
    return wrapped


def _check_arguments(optimizer, compression, sparse_as_dense, predivide, op, passes, average_aggregated, num_groups,
                     groups, process_set, scale_local) -> GradientReduction:
    if op not in (Average, Sum):
        raise InvalidArgumentError(f"op must be sparktrain.keras.Average or Sum for gradients, got {op!r}")
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise InvalidArgumentError(f"compression must be Compression.none or Compression.fp16 (an object with compress "
                              f"and decompress), got {compression!r}")
    if isinstance(predivide, bool) or not isinstance(predivide, (int, float)) or not predivide > 0:
        raise InvalidArgumentError(f"gradient_predivide_factor must be a positive number, got {predivide!r}")
    if predivide != 1.0 and op != Average:
        raise InvalidArgumentError(f"gradient_predivide_factor={predivide!r} needs op=Average (it splits the averaging "
                              f"before and after the sum), got op={op!r}")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise InvalidArgumentError(f"backward_passes_per_step must be a whole number of at least 1, got {passes!r}")
    if passes > 1 and getattr(optimizer, "gradient_accumulation_steps", None):
        raise InvalidArgumentError(
            f"the optimizer already accumulates gradients (gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}); set either that or backward_passes_per_step={passes}, not both")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise InvalidArgumentError(f"num_groups must be a whole number >= 0, got {num_groups!r}")
    if num_groups:
        warnings.warn("num_groups is deprecated, as in Horovod: pass groups=", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) and all(isinstance(g, (list, tuple)) for g in groups)) \
            and not (isinstance(groups, int) and not isinstance(groups, bool) and groups > 0):
        raise InvalidArgumentError(f"groups must be a positive number of groups or a list of lists of variables, "
                              f"got {groups!r}")
    process_set = check_process_set(process_set)
    return GradientReduction(op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
                             gradient_predivide_factor=float(predivide), backward_passes_per_step=passes,
                             average_aggregated_gradients=bool(average_aggregated), groups=groups,
                             scale_local_gradients=bool(scale_local), process_set=process_set)


def _AgreeingLossScale() -> type:  # noqa: N802 - returns a class
    """``keras.optimizers.LossScaleOptimizer`` whose overflow check is every rank's together.

    The plain one checks each rank's own gradients for inf/NaN and skips the update where they
    are not finite; a rank that overflowed alone would then skip the gradient collective the
    others wait in. Here a step is skipped (and the scale lowered) on every rank or on none.
    """
    import keras

    cls = _agreeing_loss_scale[0] if _agreeing_loss_scale else None
    if cls is None:
        def check_finite(self, grads):
            import tensorflow as tf

            finite = keras.optimizers.LossScaleOptimizer.check_finite(self, grads)
            if size() == 1:
                return finite
            return allreduce(tf.cast(finite, tf.int32), op=Min) > 0

        cls = type("LossScaleOptimizer", (keras.optimizers.LossScaleOptimizer,), {
            "check_finite": check_finite,
            "_sparktrain_distributed": True,
            "__module__": keras.optimizers.LossScaleOptimizer.__module__,
            "__doc__": _AgreeingLossScale.__doc__,
        })
        _agreeing_loss_scale.append(cls)
    return cls


def agree_on_overflow(model) -> bool:
    """Make the plain ``LossScaleOptimizer`` that ``model.compile`` wrapped around a
    DistributedOptimizer (under a ``mixed_float16`` policy) skip overflowing steps on every rank
    together. Call before the train step is traced; returns whether it changed anything.
    """
    import keras

    opt = getattr(model, "optimizer", None)
    if type(opt) is keras.optimizers.LossScaleOptimizer and \
            getattr(type(opt.inner_optimizer), "_sparktrain_distributed", False):
        opt.__class__ = _AgreeingLossScale()  # a subclass overriding one method, with no state of its own
        return True
    return False


def _distributed_class(base: type) -> type:
    """The DistributedOptimizer subclass of ``base``; for a LossScaleOptimizer, the one whose
    ranks agree on overflow (its inner optimizer does the reducing)."""
    import keras

    if issubclass(base, keras.optimizers.LossScaleOptimizer):
        return _AgreeingLossScale()
    cls = _wrapped_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "_backend_update_step": _backend_update_step,
            "_clip_gradients": _clip_gradients,
            "register_local_var": register_local_var,
            "_sparktrain_distributed": True,
            "__module__": base.__module__,
            "__doc__": f"{base.__name__} whose gradients are reduced over every sparktrain rank.",
        })
        _wrapped_classes[base] = cls
    return cls


def register_local_var(self, var) -> None:
    """Treat ``var`` as local to this rank: its gradient is not reduced, and
    ``BroadcastGlobalVariablesCallback`` does not broadcast it. Call it before training."""
    reduction = _reduction_of(self)
    reduction.local_vars[id(var)] = var


def _reduction_of(optimizer) -> GradientReduction:
    reduction = getattr(optimizer, "_sparktrain_reduction", None)
    if reduction is None:  # loaded by load_model: Horovod's defaults
        reduction = GradientReduction()
        optimizer._sparktrain_reduction = reduction
    return reduction


def local_variables(optimizer) -> list:
    """The variables ``optimizer`` keeps local (registered, or in its ``local_layers``); [] for others."""
    reduction = getattr(optimizer, "_sparktrain_reduction", None)
    if reduction is None:
        return []
    found = dict(reduction.local_vars)
    for layer in reduction.local_layers:
        found.update((id(v), v) for v in layer.weights)
    return list(found.values())


def _backend_update_step(self, grads, trainable_variables, learning_rate):
    # Every Keras 3 release from 3.2 on (master too) calls _backend_update_step(grads, variables,
    # learning_rate) once per applied update, with the gradients unscaled and, when it
    # accumulates, already summed and averaged over the passes: the one place to reduce. Keras
    # 3.2 clips in apply() (every pass, before accumulating), later releases just before this
    # call; so Keras's own clipping is deferred (_clip_gradients below) and done here, after the
    # reduction, as Horovod does, whichever release runs.
    base = super(type(self), self)
    grads = reduce_gradients(list(grads), list(trainable_variables), _reduction_of(self))
    grads = base._clip_gradients(grads)
    return base._backend_update_step(grads, trainable_variables, learning_rate)


def _clip_gradients(self, grads):
    # Deferred to _backend_update_step: clipping applies to the reduced gradients.
    return grads


def reduce_gradients(grads: list, variables: list, reduction: GradientReduction) -> list:
    """Reduce ``grads`` (one per variable in ``variables``) as ``reduction`` says; None stays None."""
    import tensorflow as tf

    local = reduction.local_ids()
    f = reduction.gradient_predivide_factor
    # Horovod's split of the average around the sum: 1/f before, f after (and Average's 1/size).
    out = reduce_except_local(grads, variables, lambda v: id(v) in local, reduction.scale_local_gradients,
                                   op=reduction.op, compression=reduction.compression,
                                   sparse_as_dense=reduction.sparse_as_dense, prescale_factor=1.0 / f,
                                   postscale_factor=f, groups=reduction.groups,
                                   process_set=reduction.process_set or global_process_set)
    if reduction.backward_passes_per_step > 1 and not reduction.average_aggregated_gradients:
        # Keras averages the accumulated passes; Horovod's default is their sum.
        passes = float(reduction.backward_passes_per_step)
        out = [g if g is None else tf.IndexedSlices(g.values * passes, g.indices, g.dense_shape)
               if isinstance(g, tf.IndexedSlices) else g * tf.cast(passes, g.dtype) for g in out]
    return out


def tensorflow_distributed_optimizer(optimizer, name: str | None = None, use_locking: bool = False,
                                     device_dense: str = "", device_sparse: str = "", compression=Compression.none,
                                     sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op=Average,
                                     gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                                     num_groups: int = 0, groups=None, process_set=global_process_set,
                                     scale_local_gradients: bool = True):
    """Horovod's ``horovod.tensorflow.DistributedOptimizer``: for a Keras optimizer, the same as
    ``sparktrain.keras.DistributedOptimizer`` (as Horovod hands Keras optimizers to its Keras
    wrapper). TensorFlow 1 optimizers (``tf.compat.v1.train.*``) are not supported: use a Keras
    optimizer, or :func:`DistributedGradientTape` in a custom loop.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer wraps Keras optimizers (keras.optimizers.*), got {type(optimizer).__name__}; "
            "TensorFlow 1 optimizers are not supported: use a Keras optimizer, or DistributedGradientTape")

    given = dict(name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
                 sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step, op=op,
                 gradient_predivide_factor=gradient_predivide_factor,
                 average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
                 process_set=process_set, scale_local_gradients=scale_local_gradients)
    defaults = dict(name=None, device_dense="", device_sparse="", compression=Compression.none,
                    sparse_as_dense=False, backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                    average_aggregated_gradients=False, num_groups=0, groups=None,
                    process_set=global_process_set, scale_local_gradients=True)
    return DistributedOptimizer(optimizer, **{k: v for k, v in given.items() if v is not defaults[k]
                                                     and v != defaults[k]})
