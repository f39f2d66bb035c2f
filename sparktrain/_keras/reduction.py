"""How a distributed optimizer reduces its gradients, on either Keras line: Horovod's arguments,
checked once into one :class:`GradientReduction`, and the reduction itself. Keras 3's hook
(``update_step``) and tf_keras' (``compute_gradients``) both hand their gradients here."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ..errors import InvalidArgumentError
from ..tensorflow.collectives import global_process_set
from ..tensorflow.compression import Compression
from ..tensorflow.gradients import check_process_set, reduce_except_local
from ..tensorflow.ops import Average, Sum


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


def check_arguments(optimizer, compression, sparse_as_dense, predivide, op, passes, average_aggregated, num_groups,
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


def register_local_var(self, var) -> None:
    """Treat ``var`` as local to this rank: its gradient is not reduced, and
    ``BroadcastGlobalVariablesCallback`` does not broadcast it. Call it before training."""
    reduction = reduction_of(self)
    reduction.local_vars[id(var)] = var


def reduction_of(optimizer) -> GradientReduction:
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


def distributed_namespace(base: type, **methods) -> dict:
    """The class body of ``base``'s distributed subclass, on either Keras line: ``methods`` (its
    reduction hooks), ``register_local_var``, the marker, and ``base``'s name and module (so a saved
    model names the user's class and loads without sparktrain)."""
    return {**methods, "register_local_var": register_local_var, "_sparktrain_distributed": True,
            "__module__": base.__module__,
            "__doc__": f"{base.__name__} whose gradients are reduced over every sparktrain rank."}
