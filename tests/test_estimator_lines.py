"""What KerasEstimator decides on the driver before a fit, without TensorFlow ranks: the dtypes each
column reaches the model in (a pure plan from the schema and the model's dtypes), and the Keras line
the ranks train with, taken from the model the user passes (Keras 3, or tf_keras for Keras 2).
Mixed lines and casts that would lose meaning are refused before any Spark job, naming the values
and the fix."""
from __future__ import annotations

import pytest

import sparktrain
from conftest import module_spark

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(120)

spark = module_spark("local[2]")


def _schema():
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = {"sales": T.DoubleType(), "store": T.IntegerType(), "open": T.BooleanType(), "share": T.FloatType(),
              "visits": T.LongType(), "pixels": VectorUDT(), "series": T.ArrayType(T.DoubleType()),
              "codes": T.ArrayType(T.ShortType())}
    return T.StructType([T.StructField(name, kind) for name, kind in fields.items()])


def test_the_dtype_plan_casts_each_column_to_its_inputs_or_outputs_dtype():
    from sparktrain.ml.dtypes import plan

    schema = _schema()

    def one(column, target, stacked=()):
        columns = [column, *stacked]
        return plan(schema, columns, [target], ["x"], "feature_cols", stacked=bool(stacked))[0]

    assert one("sales", "float32") == "float32"  # a double label reaches a float32 output as float32
    assert one("share", "float32") is None  # already the input's dtype: fed as it is
    assert one("store", "float32") == "float32" and one("store", "int32") is None and one("store", "int64") == "int64"
    assert one("open", "float32") == "float32" and one("open", "bool") is None and one("open", "int32") == "int32"
    assert one("visits", "float32") == "float32" and one("sales", "float64") is None
    assert one("pixels", "float32") is None and one("pixels", "float64") == "float64"  # Vectors are fed as float32
    assert one("series", "float32") == "float32" and one("codes", "int32") == "int32"
    assert one("sales", None) is None  # a tensor of no known dtype: fed as it is
    assert one("store", "float32", stacked=["sales"]) == "float32"  # the stack's common dtype is float64
    assert one("share", "float32", stacked=["share"]) is None
    assert plan(schema, ["sales", "store"], ["float16", "int32"], ["a", "b"], "label_cols") == ["float16", None]


@pytest.mark.parametrize("column, target, words", [
    ("sales", "int32", ["feature_cols: column 'sales' (double, fed as float64)", "model's 'x'", "takes int32",
                        "whole numbers", "F.col('sales').cast('int')", "dtype='float64'"]),
    ("pixels", "int64", ["'pixels'", "fed as float32", "takes int64", ".cast('bigint')"]),
    ("store", "bool", ["'store' (int, fed as int32)", "takes bool", "booleans", ".cast('boolean')"]),
    ("share", "string", ["'share' (float, fed as float32)", "takes string", "numbers only", "StringIndexer"]),
])
def test_a_cast_that_would_lose_meaning_is_refused_naming_the_column_the_dtypes_and_the_fix(column, target, words):
    from sparktrain.ml.dtypes import plan

    with pytest.raises(sparktrain.InvalidArgumentError) as e:
        plan(_schema(), [column], [target], ["x"], "feature_cols")
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_the_models_dtypes_are_read_from_either_keras_line():
    import keras

    from sparktrain.ml.dtypes import of

    tf_keras = pytest.importorskip("tf_keras")
    for k in (keras, tf_keras):
        ids, amount = k.Input((1,), dtype="int32", name="ids"), k.Input((3,), name="amount")
        out = k.layers.Dense(1)(k.layers.Concatenate()([k.layers.Flatten()(k.layers.Embedding(4, 2)(ids)), amount]))
        model = k.Model([ids, amount], out)
        assert of(model.inputs) == ["int32", "float32"] and of(model.outputs) == ["float32"], k.__name__


def _jobs_started(spark) -> int:
    return int(spark.sparkContext._jsc.sc().dagScheduler().nextJobId())


def _frame(spark):
    return spark.createDataFrame([(1, 2.5, 0.7, True)] * 4, "store int, share double, sales double, val boolean")


def _model(k):
    inputs = [k.Input((1,), name="store"), k.Input((1,), name="share")]
    return k.Model(inputs, k.layers.Dense(1)(k.layers.Concatenate()(inputs)))


@pytest.mark.spark
@pytest.mark.keras2
def test_a_tf_keras_model_is_planned_for_tf_keras_ranks_and_mixed_lines_are_refused_before_any_job(spark, tmp_path):
    import keras

    from sparktrain.ml import KerasEstimator
    from sparktrain.ml.portable import KerasModelFile, KerasObject, unpack

    tf_keras = pytest.importorskip("tf_keras")
    df = _frame(spark)
    ok = dict(model=_model(tf_keras), optimizer=tf_keras.optimizers.Adam(0.01), loss="mae",
              metrics=[tf_keras.metrics.MeanAbsoluteError()], feature_cols=["store", "share"], label_cols=["sales"],
              validation="val", num_proc=2, store=f"file://{tmp_path}/never-written")
    before = _jobs_started(spark)
    spec, data, launch = KerasEstimator(**ok)._prepare(df)
    assert spec.keras_line == "tf_keras" and launch["env"]["TF_USE_LEGACY_KERAS"] == "1"
    assert spec.feature_dtypes == ["float32", "float32"] and spec.label_dtypes == ["float32"]
    assert isinstance(spec.optimizer, KerasObject)  # tf_keras' optimizers do not pickle: they travel as config
    assert type(unpack(spec.optimizer)) is tf_keras.optimizers.Adam
    assert type(unpack(KerasModelFile(spec.model, spec.keras_line))).__module__.startswith("tf_keras.")
    k3_spec, _, k3_launch = KerasEstimator(**dict(ok, model=_model(keras), optimizer=keras.optimizers.Adam(0.01),
                                                  metrics=["mae"]))._prepare(df)
    assert k3_spec.keras_line == "keras" and k3_launch["env"]["TF_USE_LEGACY_KERAS"] == "0"
    assert set(data) == {"train", "val"} and _jobs_started(spark) == before
    for case, params, words in [
        ("Keras 3 optimizer", dict(ok, optimizer=keras.optimizers.Adam(0.01)),
         ["Keras 3 and tf_keras objects cannot train together", "optimizer is keras.src.optimizers.adam.Adam",
          "model is tf_keras.", "TF_USE_LEGACY_KERAS=1"]),
        ("Keras 3 metric", dict(ok, metrics=["mse", keras.metrics.MeanSquaredError()]), ["metrics[1] is keras."]),
        ("Keras 3 checkpoint", dict(ok, checkpoint_callback=keras.callbacks.ModelCheckpoint("b.keras")),
         ["checkpoint_callback is keras.", "model is tf_keras."]),
        ("env asks for Keras 3", dict(ok, env={"TF_USE_LEGACY_KERAS": "0"}),
         ["the model is tf_keras", "TF_USE_LEGACY_KERAS=0", "leave TF_USE_LEGACY_KERAS out of env"]),
        ("env asks for tf_keras", dict(ok, model=_model(keras), optimizer=keras.optimizers.Adam(0.01), metrics=None,
                                       backend_env={"TF_USE_LEGACY_KERAS": "true"}),
         ["the model is Keras 3", "TF_USE_LEGACY_KERAS=true", "asks for tf_keras"]),
        ("not a model", dict(ok, model=tf_keras.optimizers.Adam()), ["model must be a Keras model",
                                                                      "tf_keras.src.optimizers.adam.Adam"]),
    ]:
        with pytest.raises(sparktrain.InvalidArgumentError) as e:
            KerasEstimator(**params).fit(df)
        assert _jobs_started(spark) == before, case
        for word in words:
            assert word in str(e.value), (case, str(e.value))


def test_labels_are_planned_in_the_shape_of_the_models_outputs_on_either_keras_line():
    """A label of one value per row reaches an output of one value as (batch, 1), as Horovod fed it
    (Keras 3 hands a metric y_true as it comes: (batch,) against (batch, 1) broadcast to (batch, batch));
    a class id for an output of several classes stays as it is; a flat array takes its output's shape.
    sparktrain.data's model= follows the same rule."""
    import keras
    import numpy as np

    from sparktrain.data.shaping import label_shaper
    from sparktrain.ml.shapes import label_shapes, model_shapes

    tf_keras = pytest.importorskip("tf_keras")
    for k in (keras, tf_keras):
        x = k.Input((4,), name="x")
        outputs = [k.layers.Dense(1, name="price")(x), k.layers.Dense(5, activation="softmax", name="kind")(x),
                   k.layers.Reshape((2, 2), name="grid")(k.layers.Dense(4)(x))]
        model = k.Model(x, outputs)
        names = ["price", "kind", "grid"]
        planned = label_shapes(["p", "k", "g"], {"p": 1, "k": 1, "g": 4}, model_shapes(model.outputs), names)
        assert planned == [(1,), None, (2, 2)], (k.__name__, planned)
        assert label_shapes(["p", "k", "g"], {"p": 1, "k": 5, "g": 4}, model_shapes(model.outputs), names)[1] == (5,)
        shaped = label_shaper(model, {"price": "p", "kind": "k", "grid": "g"})(
            {"price": np.zeros(6), "kind": np.arange(6), "grid": np.zeros((6, 4))})
        assert {n: v.shape for n, v in shaped.items()} == {"price": (6, 1), "kind": (6,), "grid": (6, 2, 2)}
        one = k.Sequential([k.Input((3,)), k.layers.Dense(1)])
        assert label_shaper(one, "y")(np.zeros(5)).shape == (5, 1)
        with pytest.raises(sparktrain.InvalidArgumentError) as e:
            label_shaper(model, {"price": "p", "kind": "k", "grid": "g"})({"price": np.zeros((6, 3))})
        for word in ["label 'p' holds 3 value(s) per row", "output 'price' has shape (1,)", "give the label 1 values"]:
            assert word in str(e.value), str(e.value)
        for label, words in [("y", ["label='y' is one label", "3 outputs", "{output_name: column}"]),
                             ({"prices": "p"}, ["['prices'] name no output", "['price', 'kind', 'grid']"])]:
            with pytest.raises(sparktrain.InvalidArgumentError) as e:
                label_shaper(model, label)
            for word in words:
                assert word in str(e.value), str(e.value)
