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
_OPT_BOOL = _optional(TypeConverters.toBoolean)

#: Params that KerasEstimator and KerasModel share.
COMMON = (
    Spec("feature_cols", "the input columns: for a model of one input, one Vector or array<numeric> column or "
         "numeric columns stacked side by side; else one column per input, in order", _NAMES),
    Spec("label_cols", "the label columns, one per model output", _NAMES),
    Spec("output_cols", "the prediction columns, one per label; default '<label>__output'", _NAMES),
    Spec("custom_objects", "custom layers, losses and metrics, by name, to load the model with", None),
    Spec("storage_options", "credentials for the store's filesystem, as fsspec takes them; never saved", None),
    Spec("run_id", "the run's name, with the elastic_url setting: a new job's fit resumes it from its last epoch "
         "backed up in <elastic_url>/<run_id>/, a finished one returns its recorded model; None: a fresh run", _STR),
)

ESTIMATOR = COMMON + (
    Spec("num_proc", "the number of ranks; None: every task slot of the cluster", _INT),
    Spec("model", "the Keras 3 or tf_keras model to train, built (with its input shape) and not compiled", None),
    Spec("optimizer", "an optimizer of the model's Keras; fit wraps it in sparktrain.keras.DistributedOptimizer",
         None),
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
    Spec("store", "where each run keeps its checkpoints, history and model: a sparktrain.ml.Store (Horovod's "
         "Store.create(url)) or an fsspec URL", None),
    Spec("max_attempts", "attempts of the training run; a retried attempt resumes from its last epoch",
         TypeConverters.toInt, 1),
    Spec("registered_model_name", "with an active MLflow run: register the model under this name", _STR),
    Spec("env", "extra environment variables for every rank", None),
    # Horovod's parameters, honoured:
    Spec("backend", "a sparktrain.ml.SparkBackend: how many ranks, and how they run (instead of num_proc)", None),
    Spec("backend_env", "more environment variables for every rank, as Horovod's", None),
    Spec("train_steps_per_epoch", "batches per epoch on every rank; None: a whole pass over the rank's shard", _INT),
    Spec("validation_steps_per_epoch", "validation batches per epoch on every rank; None: the whole validation shard",
         _INT),
    Spec("label_shapes", "the shape each label column's rows are reshaped to, one per label column", None),
    Spec("checkpoint_callback", "a Keras ModelCheckpoint-like callback, run on rank 0; the model it keeps (the best "
         "epoch's, say) is the trained model", None),
    Spec("use_gpu", "False: the ranks use no GPU; True or None: a GPU per rank where Spark gives the tasks GPUs",
         _OPT_BOOL),
    Spec("mp_start_method", "Python multiprocessing's start method on the ranks: fork, spawn or forkserver", _STR),
    Spec("shuffle_buffer_size", "0 turns shuffling off; any other size has no effect (each epoch shuffles the "
         "rank's whole shard)", _INT),
    # Horovod's performance hints for its Parquet copy of the data and petastorm's reader: no effect here.
    Spec("inmemory_cache_all", "no effect (Horovod's petastorm reader's)", _OPT_BOOL),
    Spec("train_reader_num_workers", "no effect (Horovod's petastorm reader's)", _INT),
    Spec("val_reader_num_workers", "no effect (Horovod's petastorm reader's)", _INT),
    Spec("reader_pool_type", "no effect (Horovod's petastorm reader's)", _STR),
    Spec("partitions_per_process", "no effect (Horovod's Parquet copy of the data)", _INT),
    Spec("compress_sparse_cols", "no effect (Horovod's Parquet copy of the data)", _OPT_BOOL),
)

#: Horovod's KerasEstimator parameters that have no place here, and why: refused.
NOT_SUPPORTED = {
    "transformation_fn": "rows reach the ranks as the DataFrame's columns; transform them in Spark first "
                         "(df.mapInPandas(fn, schema) does what petastorm's TransformSpec did)",
    "transformation_edit_fields": "rows reach the ranks as the DataFrame's columns; transform them in Spark first",
    "transformation_removed_fields": "rows reach the ranks as the DataFrame's columns; select the columns in Spark",
    "continuous_columns": "assemble the features into one column (VectorAssembler)",
    "categorical_columns": "encode categories in Spark first (StringIndexer, OneHotEncoder)",
}

#: Horovod's performance hints, accepted with one log line per fit: they tune what sparktrain has not.
NO_EFFECT = {
    "inmemory_cache_all": "each rank memory-maps its spooled shard, or its cache of the row groups it reads from "
                          "files (data_cache_limit), so the OS already caches it",
    "train_reader_num_workers": "there is no petastorm reader: each rank memory-maps its spooled shard",
    "val_reader_num_workers": "there is no petastorm reader: each rank memory-maps its spooled shard",
    "reader_pool_type": "there is no petastorm reader: each rank memory-maps its spooled shard, or reads its row "
                        "groups of a Parquet scan itself",
    "partitions_per_process": "there is no Parquet copy of the data: the feed deals rows evenly over the ranks",
    "compress_sparse_cols": "there is no Parquet copy of the data: sparse vectors reach the ranks as dense arrays",
    "shuffle_buffer_size": "each epoch shuffles the rank's shard anew, whole or, as it streams from files, in a "
                           "buffer of up to 262,144 rows; 0 turns shuffling off, as in Horovod",
}

MODEL = COMMON + (
    Spec("model_url", "where the trained model is, in the store (a .keras file)", _STR),
    Spec("history", "the training history: {metric: [value per epoch]}", None),
    Spec("batch_size", "rows per prediction batch", TypeConverters.toInt, 1024),
    Spec("keras_line", "the Keras that loads the model: 'keras' (Keras 3) or 'tf_keras' (Keras 2)", _STR, "keras"),
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
