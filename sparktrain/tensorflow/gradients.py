"""Reducing gradients over the ranks: ``allreduce_gradients`` (shared by the gradient tape and
``sparktrain.keras``'s optimizer) and Horovod's ``DistributedGradientTape`` /
``PartialDistributedGradientTape``."""
from __future__ import annotations

import warnings

from . import buckets, collectives, ops, process_sets
from .compression import Compression
from .ops import Average
from ..errors import InvalidArgumentError


def _tf():
    import tensorflow as tf

    return tf


def _check_groups(num_groups, groups):
    """Horovod's rule: ``num_groups`` is the deprecated spelling of an integer ``groups``."""
    if num_groups:
        warnings.warn("num_groups is deprecated, as in Horovod: pass groups=", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not isinstance(groups, list) and (
            isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0):
        raise InvalidArgumentError(f"groups must be a positive number of groups or a list of lists of variables, "
                                   f"got {groups!r}")
    return groups


def _split_even(items: list, n: int) -> list:
    """``items`` in ``n`` consecutive groups of near-equal length (Horovod's ``split_list``)."""
    n = max(1, min(n, len(items)))
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def allreduce_gradients(grads, *, variables=None, op=Average, compression=Compression.none,
                        sparse_as_dense: bool = False, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        num_groups: int = 0, groups=None, process_set=process_sets.global_process_set):
    """Reduce a (possibly nested) structure of gradients over the ranks of ``process_set``
    (default: all); same structure back. On a rank outside the set they come back unreduced, as
    Horovod's do.

    None stays None. Dense gradients are reduced in fused collectives (one per dtype) unless
    ``groups`` asks otherwise: an int splits them into that many consecutive groups, a list of
    lists of variables (with ``variables``, the gradients' variables in order) puts each inner
    list's gradients in one group and every other gradient in a group of its own, as Horovod.
    Inside a ``tf.function`` (and ``bucket_bytes`` not 0) the dense gradients go in buckets, or the
    groups are taken as buckets, last variables first, each reduced while backprop goes on
    (``buckets``); the sums are the same bits.
    ``tf.IndexedSlices`` are reduced as sparse (values and indices allgathered; Average divides
    the values by the size) unless ``sparse_as_dense``, which densifies them first.
    """
    tf = _tf()
    op = ops.check_op(op)
    groups = _check_groups(num_groups, groups)
    if not check_process_set(process_set).included():
        return grads
    flat = tf.nest.flatten(grads, expand_composites=False)
    present = [i for i, g in enumerate(flat) if g is not None]
    if sparse_as_dense:
        flat = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in flat]
    overlap = False
    if groups is None:
        batches = [present] if present else []
        dense = [i for i in present if not isinstance(flat[i], tf.IndexedSlices)]
        split = buckets.plan([flat[i] for i in dense])
        if split is not None:
            overlap = True
            batches = [[dense[j] for j in b] for b in split] + [[i for i in present if i not in set(dense)]]
    elif isinstance(groups, int):
        batches = _split_even(present, groups)
    else:
        if variables is None or len(variables) != len(flat):
            raise InvalidArgumentError("groups as lists of variables needs variables=, one per gradient, in order")
        where = {v.ref() if hasattr(v, "ref") else id(v): i for i, v in enumerate(variables)}
        taken: set = set()
        batches = []
        for group in groups:
            idx = []
            for v in group:
                i = where.get(v.ref() if hasattr(v, "ref") else id(v))
                if i is not None and flat[i] is not None and i not in taken:
                    idx.append(i)
                    taken.add(i)
            batches.append(sorted(idx))
        batches += [[i] for i in present if i not in taken]
    if groups is not None and buckets.enabled():  # the groups as buckets, the last variables' first
        overlap, batches = True, batches[::-1]
    batches = [idx for idx in batches if idx]
    out = list(flat)
    for number, idx in enumerate(batches):
        label = buckets.label(number, len(batches), sum(buckets.nbytes(flat[i]) or 0 for i in idx)) if overlap \
            else None
        reduced = collectives.reduce_group([flat[i] for i in idx], op, compression, prescale_factor,
                                           postscale_factor, process_set, bucket=label)
        for i, r in zip(idx, reduced):
            out[i] = r
    return tf.nest.pack_sequence_as(grads, out)


def reduce_except_local(grads: list, variables: list, is_local, scale_local: bool, **options) -> list:
    """Reduce ``grads`` (one per variable of ``variables``) with :func:`allreduce_gradients` and
    ``options``, except those whose variable ``is_local`` says is this rank's own: they are not
    reduced and, with ``scale_local`` (Horovod's ``scale_local_gradients``), are divided by the
    size (of the ``process_set`` in ``options``). None stays None. The gradient tape and the Keras
    optimizer both reduce this way."""
    tf = _tf()
    shared = [i for i, (g, v) in enumerate(zip(grads, variables)) if g is not None and not is_local(v)]
    out = list(grads)
    if shared:
        reduced = allreduce_gradients([grads[i] for i in shared], variables=[variables[i] for i in shared], **options)
        for i, r in zip(shared, reduced):
            out[i] = r
    if scale_local:
        n = float(options.get("process_set", process_sets.global_process_set).size())
        for i, (g, v) in enumerate(zip(out, variables)):
            if g is not None and is_local(v):
                out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices) \
                    else g / n
    return out


def average_gradients(grads, op=Average):
    """Allreduce a (possibly nested) list of gradients in fused collectives; None stays None.

    ``tf.IndexedSlices`` are densified first (the Keras optimizer's historic behaviour).
    """
    return allreduce_gradients(grads, op=op, sparse_as_dense=True)


def check_process_set(process_set):
    """``process_set`` (a registered :class:`ProcessSet`; None: every rank's), or an error naming
    the fix."""
    if process_set is None:
        return process_sets.global_process_set
    if not isinstance(process_set, process_sets.ProcessSet) or process_set.process_set_id is None:
        raise InvalidArgumentError(f"process_set={process_set!r}: pass global_process_set or a ProcessSet registered "
                                   "with hvd.add_process_set (or hvd.init(process_sets=[...]))")
    return process_set


def _predivide(op, gradient_predivide_factor):
    """Horovod's split of the average around the sum: pre 1/f, post f (the average's 1/size on top)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidArgumentError(f"gradient_predivide_factor={gradient_predivide_factor!r} applies to op=Average "
                                   f"only, got op={ops.name_of(op)}")
    return (1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == Average else (1.0, 1.0)


class _DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient`` reduces the gradients over all ranks."""

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        tf = _tf()
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False) if grads is not None else []
        out = reduce_except_local(flat_grads, flat_sources, self._is_local, self._sparktrain_scale_local,
                                  **self._sparktrain_options)
        return tf.nest.pack_sequence_as(grads, out, expand_composites=False)

    def _is_local(self, source) -> bool:
        return (source.ref() if hasattr(source, "ref") else id(source)) in self._sparktrain_local

    def register_local_source(self, source):
        """Keep ``source``'s gradient local: it is not reduced (and, with scale_local_gradients,
        divided by the size, as Horovod does)."""
        self._sparktrain_local.add(source.ref() if hasattr(source, "ref") else id(source))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``(local, global)``: lists of ``(source, gradient)`` pairs, split by registration."""
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if self._is_local(s) else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",  # noqa: N802 - Horovod's
                            compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                            process_set=collectives.global_process_set, scale_local_gradients: bool = True):
    """Wrap a ``tf.GradientTape`` so ``gradient()`` returns gradients reduced over all ranks (or the
    ranks of ``process_set``; on a rank outside it, unreduced).

    The result is a tape of the same class, recording what the given tape recorded. Arguments
    as Horovod's: ``gradient_predivide_factor`` (Average only) divides before the sum and
    multiplies after it; ``groups`` / ``num_groups`` group the reductions (see
    :func:`allreduce_gradients`); :meth:`register_local_source` keeps a variable's gradient local.

    Example
    -------
    >>> with tf.GradientTape() as tape:            # doctest: +SKIP
    ...     loss = loss_fn(y, model(x, training=True))
    >>> tape = hvd.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)
    """
    tf = _tf()
    if not isinstance(gradtape, tf.GradientTape):
        raise InvalidArgumentError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    op = ops.check_op(op)
    process_set = check_process_set(process_set)
    pre, post = _predivide(op, gradient_predivide_factor)
    groups = _check_groups(num_groups, groups)
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedGradientTape, base), {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording: its tape, persistence, watched variables
    tape._sparktrain_options = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                    prescale_factor=pre, postscale_factor=post, groups=groups,
                                    process_set=process_set)
    tape._sparktrain_local = set()
    tape._sparktrain_scale_local = bool(scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",  # noqa: N802
                                   compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                                   process_set=collectives.global_process_set, local_layers=None,
                                   scale_local_gradients: bool = True):
    """A :func:`DistributedGradientTape` whose ``local_layers`` (a Keras layer or a list of
    them) keep their gradients local: their trainable weights are registered local sources."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        if not hasattr(layer, "trainable_weights"):
            raise InvalidArgumentError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        for w in layer.trainable_weights:
            tape.register_local_source(w)
    return tape
