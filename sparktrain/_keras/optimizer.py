"""Horovod's ``DistributedOptimizer``, ``PartialDistributedOptimizer`` and ``load_model``, written once
for both Keras lines on TensorFlow: each takes the :class:`Line` its front binds, the Keras module and
what differs between the lines (where the gradients are reduced: Keras 3's update step,
``update_step``, or where tf_keras computes them, ``compute_gradients``; how a loss scale is rebuilt).

The distributed optimizer is a subclass of the user's optimizer class, built from its config, so it
keeps its class's name and a saved model loads without sparktrain.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

from .. import kerasline
from ..errors import InvalidArgumentError
from ..tensorflow.collectives import global_process_set
from ..tensorflow.compression import Compression
from ..tensorflow.ops import Average
from .reduction import GradientReduction, check_arguments


@dataclasses.dataclass(frozen=True)
class Line:
    """A Keras line's module and what its optimizers need that differs between the lines."""

    #: ``keras`` (Keras 3) or ``tf_keras``.
    keras: Any
    #: The optimizer classes a distributed optimizer may wrap.
    optimizers: tuple
    #: The line's ``LossScaleOptimizer``.
    loss_scale: type
    #: The distributed subclass of an optimizer class.
    subclass: Callable[[type], type]
    #: The distributed optimizer's config from the user's and ``backward_passes_per_step``.
    configured: Callable[[dict, int], dict]
    #: A loss scale rebuilt around its distributed inner optimizer: ``(optimizer, distribute, name)``.
    rewrap_loss_scale: Callable[[Any, Callable, Any], Any]


def _distributed(optimizer) -> bool:
    return getattr(type(optimizer), "_sparktrain_distributed", False)


def create_distributed_optimizer(line: Line, optimizer, reduction: GradientReduction, name: str | None = None):
    """``optimizer`` as its distributed subclass, reducing as ``reduction`` says; a loss scale comes
    back around a distributed inner optimizer; one already distributed (say, from ``load_model``)
    comes back as it is, reduced once per update."""
    if isinstance(optimizer, line.loss_scale):
        if _distributed(optimizer):
            return optimizer
        return line.rewrap_loss_scale(
            optimizer, lambda inner, inner_name: create_distributed_optimizer(line, inner, reduction, inner_name), name)
    if _distributed(optimizer):
        return optimizer
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = line.subclass(type(optimizer)).from_config(line.configured(config, reduction.backward_passes_per_step))
    wrapped._sparktrain_reduction = reduction
    return wrapped


def distributed_optimizer(line: Line, optimizer, name: str | None = None, device_dense: str = "",
                          device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                          gradient_predivide_factor: float = 1.0, op: str = Average, backward_passes_per_step: int = 1,
                          average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                          process_set=global_process_set, scale_local_gradients: bool = True):
    """Wrap a Keras optimizer (of the front's line) so each update first reduces the gradients over all ranks.

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

    A ``LossScaleOptimizer`` (mixed precision) is rebuilt around the distributed inner optimizer,
    with an overflow check every rank agrees on, so the ranks skip a step together: on Keras 3 a
    check of its own (pass it wrapped yourself under a ``mixed_float16`` policy: ``model.compile``
    adds a plain one, whose ranks would decide alone), on tf_keras its own check of the reduced
    gradients.

    The result keeps the original class's name (``Adam``), so a saved model loads without
    sparktrain. An optimizer that is already distributed (from :func:`load_model`) comes back
    as it is. Clipping and weight decay happen after the reduction, as with Horovod.
    """
    if not isinstance(optimizer, line.optimizers):
        raise InvalidArgumentError(
            f"DistributedOptimizer needs a Keras optimizer (keras.optimizers.* for Keras 3, or tf.keras.optimizers.* "
            f"under TF_USE_LEGACY_KERAS=1 for tf_keras), got {type(optimizer).__module__}.{type(optimizer).__name__}")
    unwrapped = optimizer.inner_optimizer if isinstance(optimizer, line.loss_scale) else optimizer
    reduction = check_arguments(unwrapped, compression, sparse_as_dense, gradient_predivide_factor, op,
                                backward_passes_per_step, average_aggregated_gradients, num_groups, groups,
                                process_set, scale_local_gradients)
    return create_distributed_optimizer(line, optimizer, reduction, name)


def partial_distributed_optimizer(line: Line, optimizer, name: str | None = None, device_dense: str = "",
                                  device_sparse: str = "", compression=Compression.none,
                                  sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                  op: str = Average, backward_passes_per_step: int = 1,
                                  average_aggregated_gradients: bool = False, groups=None,
                                  process_set=global_process_set, local_layers=None,
                                  scale_local_gradients: bool = True):
    """A :func:`DistributedOptimizer` whose ``local_layers`` (a layer or a list) train on each rank's
    own gradients: their variables' gradients are never reduced.

    Pair it with ``BroadcastGlobalVariablesCallback(0, local_variables=...)`` or leave it to the
    callback, which skips every variable this optimizer treats as local. The layers may be
    unbuilt here; their weights are looked up when gradients are first applied.
    """
    def is_layer(obj) -> bool:  # of either Keras line: the optimizer's says why it is refused
        return kerasline.line_of(obj) is not None and hasattr(obj, "trainable_weights")

    layers = [] if local_layers is None else [local_layers] if is_layer(local_layers) else list(local_layers)
    bad = [type(layer).__name__ for layer in layers if not is_layer(layer)]
    if bad:
        raise InvalidArgumentError(f"local_layers must be Keras layers, got {', '.join(bad)}; pass model.layers[i] "
                                   "or the layer objects themselves")
    wrapped = distributed_optimizer(line, optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                    compression=compression, sparse_as_dense=sparse_as_dense,
                                    gradient_predivide_factor=gradient_predivide_factor, op=op,
                                    backward_passes_per_step=backward_passes_per_step,
                                    average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                    process_set=process_set, scale_local_gradients=scale_local_gradients)
    wrapped._sparktrain_reduction.local_layers = layers
    return wrapped


def load_model(line: Line, filepath: str, custom_optimizers=None, custom_objects=None, compression=None, **kwargs):
    """``load_model`` of the line's Keras, whose optimizer comes back distributed, with its state.

    Keras's built-in optimizers, and the classes in ``custom_optimizers``, are loaded as their
    DistributedOptimizer subclasses, as Horovod's ``hvd.load_model`` does, so training continues
    data-parallel where it stopped; ``compression`` applies to its gradients (default none).
    """
    keras = line.keras
    compression = Compression.none if compression is None else compression
    check_arguments(None, compression, False, 1.0, Average, 1, False, 0, None, None, True)
    custom = {}
    for name in dir(keras.optimizers):
        obj = getattr(keras.optimizers, name)
        if isinstance(obj, type) and issubclass(obj, keras.optimizers.Optimizer) and obj is not keras.optimizers.Optimizer:
            custom[name] = line.subclass(obj)
    for cls in custom_optimizers or []:
        custom[cls.__name__] = line.subclass(cls)
    custom.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=custom, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a loss scale keeps it inside
    if optimizer is not None and _distributed(optimizer):
        # Keras 3 saved backward_passes_per_step as gradient_accumulation_steps (tf_keras has none);
        # the rest is Horovod's defaults.
        optimizer._sparktrain_reduction = GradientReduction(
            compression=compression, backward_passes_per_step=getattr(optimizer, "gradient_accumulation_steps", 0) or 1)
    return model


def bound(line: Line) -> tuple[Callable, Callable, Callable]:
    """A front's ``DistributedOptimizer``, ``PartialDistributedOptimizer`` and ``load_model``, bound to ``line``."""
    return (bind(distributed_optimizer, line, "DistributedOptimizer"),
            bind(partial_distributed_optimizer, line, "PartialDistributedOptimizer"),
            bind(load_model, line, "load_model"))


def bind(function: Callable, line: Line, name: str) -> Callable:
    """``function`` with its first argument, the line, given: a front's ``name``, with its docstring."""
    @functools.wraps(function)
    def bound(*args, **kwargs):
        return function(line, *args, **kwargs)

    signature = inspect.signature(function)
    bound.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    bound.__name__ = bound.__qualname__ = name
    del bound.__wrapped__
    return bound
