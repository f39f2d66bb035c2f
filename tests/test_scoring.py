"""``KerasModel.transform`` through ``mapInArrow`` (``sparktrain.ml.scoring``) on a real local Spark:
every row's prediction equals what ``predict_batch_udf`` (the path it replaced) gives for the same
model, rows and batch size, bit for bit; the other columns and the rows' order stay."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import module_spark

pytestmark = [pytest.mark.timeout(240)]

spark = module_spark("local[2]")
FEATURES, ROWS, BATCH = 8, 1500, 64


def _stored_model(tmp_path, outputs: int):
    import keras

    from sparktrain import storage
    from sparktrain.ml.portable import keras_bytes

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(outputs)])
    return storage.put_bytes(f"file://{tmp_path}/model-{outputs}.keras", keras_bytes(model))


def _reference(df, url: str, out: str, scalar: bool):
    """``predict_batch_udf`` with the model loaded once per worker: the path transform took before."""
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import ArrayType, FloatType

    def make():
        from sparktrain.ml.model import load

        model = load(url)

        def predict(x):
            o = np.asarray(model.predict_on_batch(x))
            return o.reshape(len(x)).astype(np.float32) if scalar else o.reshape(len(x), -1).astype(np.float32)

        return predict

    udf = predict_batch_udf(make, return_type=FloatType() if scalar else ArrayType(FloatType()), batch_size=BATCH,
                            input_tensor_shapes=[[FEATURES]])
    return {r["id"]: r[out] for r in df.select("id", udf("x").alias(out)).collect()}


@pytest.mark.parametrize("outputs", [3, 1])
def test_transform_predicts_every_row_as_predict_batch_udf_did(spark, tmp_path, outputs):
    from pyspark.sql import functions as F

    from sparktrain.ml import KerasModel

    url = _stored_model(tmp_path, outputs)
    df = spark.range(ROWS, numPartitions=3).select(
        "id", (F.col("id") % 7).alias("tag"),
        F.array(*[(F.rand(seed=j) - 0.5).cast("float") for j in range(FEATURES)]).alias("x"))
    df = df.cache()
    model = KerasModel(model_url=url, feature_cols=["x"], label_cols=["y"], batch_size=BATCH)
    scored = model.transform(df)
    assert scored.columns == ["id", "tag", "x", "y__output"]
    rows = scored.collect()
    assert [r["id"] for r in rows] == list(range(ROWS))  # every row, in order, its columns kept
    assert all(r["tag"] == r["id"] % 7 for r in rows)
    expected = _reference(df, url, "y__output", outputs == 1)
    got = {r["id"]: r["y__output"] for r in rows}
    if outputs == 1:
        assert all(isinstance(v, float) for v in got.values())
    else:
        assert all(len(v) == outputs for v in got.values())
    assert got == expected  # bit for bit, row by row
    assert len({str(v) for v in got.values()}) > ROWS // 2  # the predictions differ between rows
