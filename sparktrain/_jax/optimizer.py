"""Horovod's ``DistributedOptimizer`` for Keras 3 on the JAX backend, through the native engine.

The distributed optimizer is a subclass of the user's optimizer class, built from its config, that
reduces the gradients over every rank inside the compiled train step (``jax.jit``), in gradient
buckets or one fused buffer per dtype (:func:`sparktrain._jax.collectives.fused_allreduce`), after Keras has
accumulated them (``backward_passes_per_step``) and before clipping and the update: the place the
TensorFlow wrapper reduces them too. No ``keras.distribution`` is needed (nor used): each rank
trains its own replica on its own batches, as on TensorFlow. No TensorFlow is imported here.
"""
from __future__ import annotations

from ..errors import InvalidArgumentError
from . import collectives

Average, Sum = "average", "sum"

_wrapped_classes: dict[type, type] = {}


class _NoCompression:
    """Gradients travel in their own dtype."""

    wire_dtype = None

    def __repr__(self):
        return "Compression.none"


class _FP16Compression:
    """Floating gradients travel as float16 and come back in their own dtype."""

    wire_dtype = "float16"

    def __repr__(self):
        return "Compression.fp16"


class Compression:
    """Horovod's gradient compressions on JAX: ``Compression.none`` and ``Compression.fp16``."""

    none = _NoCompression()
    fp16 = _FP16Compression()


class Reduction:
    """How a JAX distributed optimizer reduces its gradients (Horovod's arguments, checked)."""

    def __init__(self, op: str = Average, compression=Compression.none, predivide: float = 1.0, passes: int = 1,
                 average_aggregated: bool = False):
        self.op, self.compression, self.predivide = op, compression, float(predivide)
        self.passes, self.average_aggregated = passes, bool(average_aggregated)

    def reduce(self, grads: list) -> list:
        """``grads`` (traced JAX arrays, None for none) reduced over every rank."""
        out = collectives.fused_allreduce(list(grads), op=self.op, prescale=1.0 / self.predivide,
                                         postscale=self.predivide, wire_dtype=self.compression.wire_dtype)
        if self.passes > 1 and not self.average_aggregated:  # Keras averages the passes; Horovod sums them
            out = [g if g is None else g * self.passes for g in out]
        return out


def DistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "", device_sparse: str = "",  # noqa: N802
                         compression=Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: str = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                         process_set=None, scale_local_gradients: bool = True):
    """Wrap a Keras 3 optimizer on JAX so each update first reduces the gradients over all ranks,
    through sparktrain's native engine, in gradient buckets (``SPARKTRAIN_BUCKET_BYTES``, on CPU) or one
    fused buffer per dtype.

    Horovod's arguments, as on TensorFlow: ``compression`` (``Compression.none`` or
    ``Compression.fp16``), ``gradient_predivide_factor``, ``op`` (``Average`` or ``Sum``),
    ``backward_passes_per_step`` and ``average_aggregated_gradients``, ``name``. ``num_groups`` and
    ``groups`` are accepted and change nothing (the gradient buckets are ``SPARKTRAIN_BUCKET_BYTES``'s);
    ``sparse_as_dense`` is accepted (JAX's gradients are dense); ``device_dense`` and
    ``device_sparse`` are accepted and ignored; ``scale_local_gradients`` is accepted (no variable
    is local on JAX). ``process_set`` must be None: JAX ranks have no process sets.

    Use it without a ``keras.distribution``: each rank fits its own shard, and the broadcast and
    metric-average callbacks keep the ranks' weights and metrics together, as on TensorFlow. The
    result keeps the original class's name, so a saved model loads without sparktrain.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(f"DistributedOptimizer needs a Keras 3 optimizer (keras.optimizers.*), got "
                                   f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise InvalidArgumentError("DistributedOptimizer on JAX does not take a LossScaleOptimizer (its ranks would "
                                   "skip overflowing steps alone); wrap the inner optimizer and train in float32")
    if op not in (Average, Sum):
        raise InvalidArgumentError(f"op must be sparktrain.keras.Average or Sum for gradients, got {op!r}")
    if compression not in (Compression.none, Compression.fp16):
        raise InvalidArgumentError(f"compression must be Compression.none or Compression.fp16, got {compression!r}")
    f = gradient_predivide_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
        raise InvalidArgumentError(f"gradient_predivide_factor must be a positive number, got {f!r}")
    if f != 1.0 and op != Average:
        raise InvalidArgumentError(f"gradient_predivide_factor={f!r} needs op=Average (it splits the averaging "
                                   f"before and after the sum), got op={op!r}")
    passes = backward_passes_per_step
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise InvalidArgumentError(f"backward_passes_per_step must be a whole number of at least 1, got {passes!r}")
    if passes > 1 and optimizer.gradient_accumulation_steps:
        raise InvalidArgumentError(
            f"the optimizer already accumulates gradients (gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}); set either that or backward_passes_per_step={passes}, not both")
    if process_set is not None:
        raise InvalidArgumentError(f"process_set={process_set!r}: on JAX every rank reduces together; pass None")
    base = type(optimizer)
    if getattr(base, "_sparktrain_distributed", False):
        return optimizer
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if passes > 1:
        config["gradient_accumulation_steps"] = passes
    wrapped = distributed_class(base).from_config(config)
    wrapped._sparktrain_reduction = Reduction(op, compression, f, passes, average_aggregated_gradients)
    return wrapped


def distributed_class(base: type) -> type:
    """The JAX DistributedOptimizer subclass of ``base`` (made once per class)."""
    cls = _wrapped_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "_backend_update_step": _backend_update_step, "_clip_gradients": _clip_gradients,
            "_sparktrain_distributed": True, "__module__": base.__module__,
            "__doc__": f"{base.__name__} whose gradients are reduced over every sparktrain rank."})
        _wrapped_classes[base] = cls
    return cls


def _reduction_of(optimizer) -> Reduction:
    reduction = getattr(optimizer, "_sparktrain_reduction", None)
    if reduction is None:  # loaded from a file: Horovod's defaults
        reduction = optimizer._sparktrain_reduction = Reduction(
            passes=max(1, optimizer.gradient_accumulation_steps or 1))
    return reduction


def _backend_update_step(self, grads, trainable_variables, learning_rate):
    # Keras on JAX calls this once per train step, with the passes already accumulated and averaged
    # (on a pass that only accumulates, its result is dropped: the collective then runs under a
    # lax.cond that skips it on every rank alike). Clipping is deferred to here, after the
    # reduction, as Horovod does.
    base = super(type(self), self)
    reduction = _reduction_of(self)
    grads = list(grads)
    if self.gradient_accumulation_steps:
        import jax

        is_update = (self._iterations + 1) % self.gradient_accumulation_steps == 0
        grads = jax.lax.cond(is_update, reduction.reduce, lambda g: list(g), grads)
    else:
        grads = reduction.reduce(grads)
    grads = base._clip_gradients(grads)
    return base._backend_update_step(grads, trainable_variables, learning_rate)


def _clip_gradients(self, grads):
    # Deferred to _backend_update_step: clipping applies to the reduced gradients.
    return grads
