"""Keras 3's distributed optimizer: the gradients reduced inside Keras 3's update, and a loss scale
whose ranks agree on overflow.

The distributed subclass reduces the gradients inside the compiled train step, after Keras has
unscaled and (with ``backward_passes_per_step``) accumulated them, and before clipping and the
update, in every Keras release from 3.2 (see ``_backend_update_step``). Weight decay acts on the
variables, not the gradients, so its place does not change the result. Only the applying step
reduces: on the other passes the gradients are added to local accumulators (Keras 3's own
``gradient_accumulation_steps``) and no collective runs.
"""
from __future__ import annotations

import sys

from ..tensorflow.collectives import allreduce
from ..tensorflow.ops import Min
from ..tensorflow.runtime import size
from .reduction import distributed_namespace, reduce_gradients, reduction_of

_wrapped_classes: dict[type, type] = {}
#: The one LossScaleOptimizer subclass whose ranks agree on overflow (see agreeing_loss_scale).
_agreeing_loss_scale: list[type] = []


def distributed_class(base: type) -> type:
    """The distributed subclass of the Keras 3 optimizer class ``base``; for a LossScaleOptimizer,
    the one whose ranks agree on overflow (its inner optimizer does the reducing)."""
    import keras

    if issubclass(base, keras.optimizers.LossScaleOptimizer):
        return agreeing_loss_scale()
    cls = _wrapped_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), distributed_namespace(
            base, _backend_update_step=_backend_update_step, _clip_gradients=_clip_gradients))
        _wrapped_classes[base] = cls
    return cls


def configured(config: dict, backward_passes_per_step: int) -> dict:
    """The distributed optimizer's config: Keras 3 accumulates the passes itself."""
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    return config


def rewrap_loss_scale(optimizer, distribute, name: str | None):
    """``optimizer`` (a LossScaleOptimizer, named ``name`` if given) rebuilt around its inner optimizer
    as ``distribute(inner, name)`` makes it, its ranks agreeing on overflow."""
    return agreeing_loss_scale()(distribute(optimizer.inner_optimizer, None), initial_scale=optimizer.initial_scale,
                                 dynamic_growth_steps=optimizer.dynamic_growth_steps, name=name or optimizer.name)


def agreeing_loss_scale() -> type:
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
            "__doc__": agreeing_loss_scale.__doc__,
        })
        _agreeing_loss_scale.append(cls)
    return cls


def agree_on_overflow(model) -> bool:
    """Make the plain ``LossScaleOptimizer`` that ``model.compile`` wrapped around a
    DistributedOptimizer (under a ``mixed_float16`` policy) skip overflowing steps on every rank
    together. Call before the train step is traced; returns whether it changed anything. tf_keras'
    loss scale checks the reduced gradients, the same on every rank, and is left as it is.
    """
    opt = getattr(model, "optimizer", None)
    keras = sys.modules.get("keras")  # none of its objects exists before it is imported
    if keras is not None and type(opt) is keras.optimizers.LossScaleOptimizer and \
            getattr(type(opt.inner_optimizer), "_sparktrain_distributed", False):
        opt.__class__ = agreeing_loss_scale()  # a subclass overriding one method, with no state of its own
        return True
    return False


def _backend_update_step(self, grads, trainable_variables, learning_rate):
    # Every Keras 3 release from 3.2 on (master too) calls _backend_update_step(grads, variables,
    # learning_rate) once per applied update, with the gradients unscaled and, when it
    # accumulates, already summed and averaged over the passes: the one place to reduce. Keras
    # 3.2 clips in apply() (every pass, before accumulating), later releases just before this
    # call; so Keras's own clipping is deferred (_clip_gradients below) and done here, after the
    # reduction, as Horovod does, whichever release runs.
    base = super(type(self), self)
    grads = reduce_gradients(list(grads), list(trainable_variables), reduction_of(self))
    grads = base._clip_gradients(grads)
    return base._backend_update_step(grads, trainable_variables, learning_rate)


def _clip_gradients(self, grads):
    # Deferred to _backend_update_step: clipping applies to the reduced gradients.
    return grads
