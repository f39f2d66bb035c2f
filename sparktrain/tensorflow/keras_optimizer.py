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

from .. import kerasline
from ..errors import InvalidArgumentError
from .collectives import allreduce, global_process_set
from .compression import Compression
from .gradient_reduction import (GradientReduction, _check_arguments, _reduction_of, distributed_namespace,  # noqa: F401
                                 local_variables, reduce_gradients, register_local_var)
from .ops import Average, Min
from .runtime import size

_wrapped_classes: dict[type, type] = {}
#: The one LossScaleOptimizer subclass whose ranks agree on overflow (see _AgreeingLossScale).
_agreeing_loss_scale: list[type] = []


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
    if kerasline.line_of(optimizer) == kerasline.TF_KERAS:  # decided by the object, not by a version
        from .tf_keras_optimizer import distributed

        return distributed(optimizer, _check_arguments(
            optimizer, compression, sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
            average_aggregated_gradients, num_groups, groups, process_set, scale_local_gradients), name)
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer needs a Keras optimizer (keras.optimizers.* for Keras 3, or tf.keras.optimizers.* "
            f"under TF_USE_LEGACY_KERAS=1 for tf_keras), got {type(optimizer).__module__}.{type(optimizer).__name__}")
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
    def is_layer(obj) -> bool:  # of either Keras line
        return kerasline.line_of(obj) is not None and hasattr(obj, "trainable_weights")

    layers = [] if local_layers is None else [local_layers] if is_layer(local_layers) else list(local_layers)
    bad = [type(layer).__name__ for layer in layers if not is_layer(layer)]
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
    opt = getattr(model, "optimizer", None)
    if kerasline.line_of(opt) != kerasline.KERAS_3:
        return False  # tf_keras' loss scale checks the reduced gradients, the same on every rank
    import keras

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
        cls = type(base.__name__, (base,), distributed_namespace(
            base, _backend_update_step=_backend_update_step, _clip_gradients=_clip_gradients))
        _wrapped_classes[base] = cls
    return cls


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
    if kerasline.line_of(optimizer) is None or not hasattr(optimizer, "apply_gradients"):
        raise InvalidArgumentError(
            f"DistributedOptimizer wraps Keras optimizers (keras.optimizers.*, or tf.keras.optimizers.* for tf_keras), "
            f"got {type(optimizer).__name__}; "
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
