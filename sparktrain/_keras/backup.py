"""``BackupAndRestore``: Keras' callback of that name for a run of several ranks, its backups in the
run's home, so that a later attempt, or a later job with the same ``run_id``, resumes ``fit`` where
the last backup left it, without Horovod's elastic API.

Keras' semantics: rank 0 backs up the model's and the optimizer's variables and the epoch at the
end of every epoch; at ``fit``'s start every rank reads the last backup, loads it and ``fit`` goes
on from the epoch after it; at ``fit``'s successful end the backup is deleted (``delete_checkpoint``).
On Keras 3 and on tf_keras (``TF_USE_LEGACY_KERAS=1``), on TensorFlow.
"""
from __future__ import annotations

import pickle
from typing import Any, Mapping

from .. import context as _ctx
from ..errors import InvalidArgumentError, NotFoundError, SparkTrainError
from ..storage import rank as rank_storage
from .backend import optimizer_variables as _optimizer_variables

_FORMAT = "sparktrain-backup/1"


class BackupAndRestoreImpl:
    """Back up at the end of every epoch (rank 0), restore at ``fit``'s start (every rank).

    Parameters
    ----------
    backup_url : an fsspec URL of the backup object; None (the default): the backup's place in the
        run's home, ``<elastic_url>/<run_id>/`` (``Home.backup_url``), which needs the ``elastic_url`` setting.
    delete_checkpoint : delete the backup when ``fit`` ends without an error, as Keras does.
    storage_options : credentials for the URL's store; None: for the run's home, those
        ``run(..., storage_options=)`` was given, else the store's credentials from the environment.
    """

    def __init__(self, backup_url: str | None = None, delete_checkpoint: bool = True,
                 storage_options: Mapping[str, Any] | None = None):
        super().__init__()
        self.backend.refuse("callbacks.BackupAndRestore")
        home = rank_storage.home()
        url = backup_url or (home.backup_url() if home is not None else None)
        if not url:
            raise InvalidArgumentError(
                "BackupAndRestore keeps its backups in the run's home, <elastic_url>/<run_id>/, and no "
                "elastic_url setting reached this rank: give run(..., env={'SPARKTRAIN_ELASTIC_URL': 'abfss://...'}, "
                "run_id='name'), or pass backup_url=")
        if storage_options is None and not backup_url:  # the run's home: run(..., storage_options=)'s
            storage_options = home.options
        self.url, self.delete_checkpoint, self.storage_options = url, delete_checkpoint, storage_options
        self.restored_epoch: int | None = None

    # -- restore ----------------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        from .. import storage

        try:
            payload = pickle.loads(storage.get_bytes(self.url, self.storage_options))
        except NotFoundError:
            return
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise SparkTrainError(f"{self.url} is not a sparktrain backup; point backup_url elsewhere")
        self.backend.assign_variables(self.model.variables, payload["model"], "model")
        optimizer = self.model.optimizer
        if len(_optimizer_variables(optimizer)) != len(payload["optimizer"]) and hasattr(optimizer, "build"):
            optimizer.build(self.model.trainable_variables)  # Keras builds optimizers lazily
        self.backend.assign_variables(_optimizer_variables(optimizer), payload["optimizer"], "optimizer")
        self.restored_epoch = epoch = int(payload["epoch"])
        self.backend.start_at(self.model, epoch)  # fit reads it next

    # -- back up ----------------------------------------------------------------------------------

    def on_epoch_end(self, epoch, logs=None):
        if _ctx.rank() != 0:
            return
        from .. import storage

        values = self.backend.variable_values
        payload = {"format": _FORMAT, "epoch": epoch + 1, "model": values(self.model.variables),
                   "optimizer": values(_optimizer_variables(self.model.optimizer))}
        storage.put_bytes(self.url, pickle.dumps(payload), self.storage_options, metadata={"epoch": epoch + 1})

    def on_train_end(self, logs=None):
        self.backend.clear_start(self.model)
        if not self.delete_checkpoint:
            return
        from .. import storage

        self.backend.barrier()  # every rank has read the backup before rank 0 deletes it
        if _ctx.rank() == 0:
            fs, path = storage.filesystem(self.url, self.storage_options)
            for name in (path, path + storage.MANIFEST_SUFFIX):
                if fs.exists(name):
                    fs.rm(name)
        self.backend.barrier()  # and none reads it in a next fit before it is gone


IMPLS = [BackupAndRestoreImpl]
