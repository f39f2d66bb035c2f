"""The Params of :class:`KerasEstimator` and :class:`KerasModel`: Horovod's names on pyspark.ml's machinery.

Each parameter is a ``pyspark.ml.param.Param`` with Horovod's snake_case name (``num_proc``,
``feature_cols``...), so ``setParams(**kwargs)``, ``explainParams()``, ``copy()`` and Pipeline
persistence work as for any Spark ML stage, and each gets Horovod's camelCase accessors
(``getNumProc()``/``setNumProc(n)``).

A parameter whose value is a Python object (the model, the optimizer, callbacks) is *not JSON*:
``save`` writes those with cloudpickle beside Spark's JSON metadata (persistence.py).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from pyspark.ml.param import Param, Params, TypeConverters


class Spec(NamedTuple):
    name: str
    doc: str
    convert: Callable[[Any], Any] | None  # None: any Python object, pickled when saved
    default: Any = None


def _optional(convert):
    return lambda v: None if v is None else convert(v)


_INT = _optional(TypeConverters.toInt)
_STR = _optional(TypeConverters.toString)
_NAMES = _optional(TypeConverters.toListString)
_BOOL = TypeConverters.toBoolean

#: Params that KerasEstimator and KerasModel share.
COMMON = (
    Spec("feature_cols", "the input columns: for a model of one input, one Vector or array<numeric> column or "
         "numeric columns stacked side by side; else one column per input, in order", _NAMES),
    Spec("label_cols", "the label columns, one per model output", _NAMES),
    Spec("output_cols", "the prediction columns, one per label; default '<label>__output'", _NAMES),
    Spec("custom_objects", "custom layers, losses and metrics, by name, to load the model with", None),
    Spec("storage_options", "credentials for the store's filesystem, as fsspec takes them; never saved", None),
    Spec("run_id", "the training run's name in the store; a store that has it already resumes it", _STR),
)

ESTIMATOR = COMMON + (
    Spec("num_proc", "the number of ranks; None: every task slot of the cluster", _INT),
    Spec("model", "the Keras 3 model to train, built (with its input shape) and not compiled", None),
    Spec("optimizer", "a Keras 3 optimizer; fit wraps it in sparktrain.keras.DistributedOptimizer", None),
    Spec("loss", "the loss, as model.compile takes it", None),
    Spec("loss_weights", "the loss weights, as model.compile takes them", None),
    Spec("metrics", "the metrics, as model.compile takes them", None),
    Spec("validation", "a fraction of the rows held out for validation, or the name of a boolean column that "
         "marks them", None),
    Spec("callbacks", "more Keras callbacks, run on every rank", None),
    Spec("batch_size", "rows per batch on each rank", TypeConverters.toInt, 32),
    Spec("val_batch_size", "rows per validation batch on each rank; default batch_size", _INT),
    Spec("epochs", "passes over the training rows", TypeConverters.toInt, 1),
    Spec("verbose", "Keras's verbosity on rank 0 (0, 1 or 2); 0 also quiets the run's own lines", TypeConverters.toInt,
         1),
    Spec("random_seed", "seeds the split, the shuffling and Keras", _INT),
    Spec("shuffle", "a new order of each rank's rows every epoch", _BOOL, True),
    Spec("sample_weight_col", "a numeric column of per-row loss weights", _STR),
    Spec("gradient_compression", "sparktrain.keras.Compression.fp16 to send gradients as float16", None),
    Spec("backward_passes_per_step", "local gradient accumulation steps before each allreduce",
         TypeConverters.toInt, 1),
    Spec("store", "an fsspec URL under which each run keeps its checkpoints, history and model", _STR),
    Spec("max_attempts", "attempts of the training run; a retried attempt resumes from its last epoch",
         TypeConverters.toInt, 1),
    Spec("registered_model_name", "with an active MLflow run: register the model under this name", _STR),
    Spec("env", "extra environment variables for every rank", None),
)

MODEL = COMMON + (
    Spec("model_url", "where the trained model is, in the store (a .keras file)", _STR),
    Spec("history", "the training history: {metric: [value per epoch]}", None),
    Spec("batch_size", "rows per prediction batch", TypeConverters.toInt, 1024),
)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def with_params(specs):
    """A class decorator: the class gets one Param per spec, with a getter and a setter each."""

    def decorate(cls):
        cls._specs = {s.name: s for s in specs}
        for s in specs:
            kwargs = {"typeConverter": s.convert} if s.convert is not None else {}
            setattr(cls, s.name, Param(Params._dummy(), s.name, s.doc, **kwargs))
            cls_name = _camel(s.name)
            if not hasattr(cls, "get" + cls_name):
                setattr(cls, "get" + cls_name, lambda self, _n=s.name: self.getOrDefault(_n))
            setattr(cls, "set" + cls_name, lambda self, value, _n=s.name: self._set(**{_n: value}))
        return cls

    return decorate


def set_defaults(instance: Params) -> None:
    instance._setDefault(**{s.name: s.default for s in instance._specs.values()})


def json_params(instance: Params) -> dict:
    """The set params that Spark's JSON metadata holds (the others are pickled; storage_options never saved)."""
    return {p.name: v for p, v in instance._paramMap.items()
            if instance._specs[p.name].convert is not None or p.name == "history"}


def object_params(instance: Params) -> dict:
    """The set params that are Python objects, pickled when saved; storage_options is left out."""
    return {p.name: v for p, v in instance._paramMap.items()
            if instance._specs[p.name].convert is None and p.name not in ("history", "storage_options")}
