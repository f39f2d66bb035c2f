"""One spark-submit job of a named run, for tests/test_resume_jobs.py.

    spark-submit resume_job.py API JOB RUN_ID URL OUT [KILL_IN_EPOCH]

API is ``run`` or ``run_elastic``; JOB names this job's files under OUT; the run's home is
``URL/RUN_ID``. A 6-epoch seeded Keras fit on 2 ranks, committing at every epoch end through
``hvd.elastic``; in epoch KILL_IN_EPOCH (if given) rank 0 writes ``in-epoch`` and every rank
waits for the test to SIGKILL this driver. Written under OUT: ``driver-JOB.pid``,
``rank-JOB-<r>.pid``, ``epochs-JOB`` (the epochs rank 0 began), ``called-JOB`` and
``first-step-JOB`` (wall-clock times of the call and of rank 0's first step), ``entered-JOB``
(when rank 0 called the ``@hvd.elastic.run`` function), ``returned-JOB``
and ``weights-JOB.json`` (rank 0's weights). The store's credentials come from the environment.
"""
import json
import os
import sys
import time

import sparktrain

#: Seconds a lease lasts unrenewed (renewed every third): short, so that a killed driver's lease
#: expires soon, and long enough that a loaded machine's late renewal does not let it lapse.
LEASE_TIMEOUT = "9"


def train(out, job, kill_in_epoch):
    import os
    import threading
    import time

    import keras
    import numpy as np

    import sparktrain.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    with open(os.path.join(out, f"rank-{job}-{r}.pid"), "w") as f:
        f.write(str(os.getpid()))
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    x, y = x[r::n], y[r::n]
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)

    class Mark(keras.callbacks.Callback):
        first = None

        def on_epoch_begin(self, epoch, logs=None):
            if r == 0:
                with open(os.path.join(out, f"epochs-{job}"), "a") as f:
                    f.write(f"{epoch}\n")
            if epoch == kill_in_epoch:
                if r == 0:
                    with open(os.path.join(out, "in-epoch"), "w") as f:
                        f.write(str(epoch))
                threading.Event().wait(300)  # until the test kills the driver

        def on_train_batch_end(self, batch, logs=None):
            if Mark.first is None and r == 0:
                Mark.first = time.time()
                with open(os.path.join(out, f"first-step-{job}"), "w") as f:
                    f.write(repr(Mark.first))

    @hvd.elastic.run
    def fit(state):
        model.fit(x, y, batch_size=20, epochs=6, initial_epoch=state.epoch, shuffle=False, verbose=0,
                  callbacks=[hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=10**6), Mark()])
        return [w.tolist() for w in model.get_weights()] if r == 0 else None

    if r == 0:  # from here: the last commit read (when resuming), every rank synced to it, the first step
        with open(os.path.join(out, f"entered-{job}"), "w") as f:
            f.write(repr(time.time()))
    return fit(state)


def _write(out: str, name: str, text: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


def main() -> None:
    from pyspark.sql import SparkSession

    api, job, run_id, url, out = sys.argv[1:6]
    kill = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    spark = SparkSession.builder.appName(f"resume-{job}").getOrCreate()
    _write(out, f"driver-{job}.pid", str(os.getpid()))
    env = {"SPARKTRAIN_ELASTIC_URL": url, "SPARKTRAIN_LEASE_TIMEOUT": LEASE_TIMEOUT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    _write(out, f"called-{job}", repr(time.time()))
    if api == "run_elastic":
        weights = sparktrain.run_elastic(train, args=(out, job, kill), num_proc=2, run_id=run_id, env=env)
    else:
        weights = sparktrain.run(train, args=(out, job, kill), num_proc=2, run_id=run_id, env=env)
    _write(out, f"returned-{job}", repr(time.time()))
    _write(out, f"weights-{job}.json", json.dumps(weights))
    spark.stop()


if __name__ == "__main__":
    main()
