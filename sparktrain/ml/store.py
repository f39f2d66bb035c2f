"""``Store``: Horovod's ``horovod.spark.common.store.Store``, for ``KerasEstimator(store=...)``.

Horovod's store holds two things: the DataFrame, written as Parquet for petastorm to read, and
each run's checkpoints, logs and trained model. sparktrain needs only the second: the rows reach
the ranks through the run's own barrier stage. So a Store is an fsspec URL, its
``storage_options``, and where the runs go (``<prefix>/runs/<run_id>/`` as in Horovod).

    from sparktrain.ml import Store
    store = Store.create("abfss://models@acct.dfs.core.windows.net/digits",
                         storage_options={"account_name": "acct", "credential": ...})

A plain URL string as ``store=`` keeps working (runs go straight under it).
"""
from __future__ import annotations

import logging
import os
import posixpath
from typing import Any, Mapping

from ..errors import InvalidArgumentError, UnsupportedError

log = logging.getLogger("sparktrain")

#: Horovod HDFSStore's connection keywords, as fsspec's HDFS filesystem (pyarrow's) takes them.
HDFS_OPTIONS = ("host", "port", "user", "kerb_ticket", "extra_conf")
#: Where Horovod kept the DataFrame as Parquet; sparktrain writes no copy of the data.
DATA_PATHS = ("train_path", "val_path", "test_path")


class Store:
    """Where each training run keeps its checkpoints and its trained model: Horovod's ``Store``.

    Build it with :meth:`create`, as in Horovod.

    Parameters
    ----------
    prefix_path : a local path (on a disk every executor and the driver share, such as
        ``/dbfs/...``), or an fsspec URL: ``file://``, ``abfs://``/``abfss://``, ``s3://``,
        ``hdfs://`` (fsspec's HDFS needs pyarrow's libhdfs and a Hadoop client), ``dbfs:/`` (read as
        ``/dbfs/``, the Databricks mount, as Horovod's DBFSLocalStore does), or another fsspec scheme.
    runs_path : where the runs go; default ``<prefix_path>/runs``.
    storage_options : credentials and options for the URL's fsspec filesystem; never saved.
    checkpoint_filename : the name of the trained model's file in the run (``.keras`` is added
        when it has no suffix); default ``model.keras``.
    train_path, val_path, test_path : accepted, with one log line: sparktrain writes no
        intermediate copy of the data.
    save_runs : True only: the trained model stays in the store, where the KerasModel reads it.
    driver : ``"libhdfs"`` only (pyarrow's; libhdfs3 is gone from pyarrow).
    temp_dir : the local directory where the ranks keep files before they go to the store (each
        rank's ``TMPDIR``).
    host, port, user, kerb_ticket, extra_conf : HDFSStore's connection settings, for ``hdfs://``.

    >>> Store.create("/tmp/models").runs_url
    'file:///tmp/models/runs'
    """

    def __init__(self, prefix_path: str, train_path: str | None = None, val_path: str | None = None,
                 test_path: str | None = None, runs_path: str | None = None, save_runs: bool = True,
                 storage_options: Mapping[str, Any] | None = None, checkpoint_filename: str | None = None,
                 driver: str | None = None, temp_dir: str | None = None, **hdfs: Any):
        if not isinstance(prefix_path, str) or not prefix_path:
            raise InvalidArgumentError(f"Store.create({prefix_path!r}): give a local path or an fsspec URL, e.g. "
                                       "'abfss://container@account.dfs.core.windows.net/models' or '/dbfs/models'")
        unknown = sorted(set(hdfs) - set(HDFS_OPTIONS))
        if unknown:
            raise InvalidArgumentError(f"Store.create takes no {unknown}; its keywords: prefix_path, runs_path, "
                                       f"storage_options, checkpoint_filename, temp_dir, {', '.join(DATA_PATHS)}, "
                                       f"save_runs, driver, {', '.join(HDFS_OPTIONS)}")
        if save_runs is not True:
            raise UnsupportedError(f"Store.create(save_runs={save_runs!r}): each run keeps its checkpoints and its "
                                   "trained model in the store, and the KerasModel reads the model from there. Leave "
                                   "save_runs out")
        self.prefix_url = url_of(prefix_path)
        self.runs_url = url_of(runs_path) if runs_path else posixpath.join(self.prefix_url, "runs")
        self.storage_options = dict(storage_options or {})
        self.model_filename = _model_filename(checkpoint_filename)
        self.temp_dir = temp_dir
        hdfs_given = {k: v for k, v in hdfs.items() if v is not None}
        if (hdfs_given or driver) and not self.prefix_url.startswith("hdfs://"):
            raise InvalidArgumentError(f"Store.create: {sorted(hdfs_given) or ['driver']} are HDFS settings, and "
                                       f"{self.prefix_url!r} is not an hdfs:// URL: leave them out")
        if driver not in (None, "libhdfs"):
            raise UnsupportedError(f"Store.create(driver={driver!r}): fsspec reaches HDFS through pyarrow's libhdfs "
                                   "only; leave driver out or pass 'libhdfs'")
        self.storage_options = {**hdfs_given, **self.storage_options}
        given = [name for name, value in zip(DATA_PATHS, (train_path, val_path, test_path)) if value is not None]
        if given:
            log.warning("Store: %s have no effect here: sparktrain writes no intermediate copy of the DataFrame (each "
                        "rank's rows reach its executor's local disk through the run's barrier stage)",
                        ", ".join(given))

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> "Store":
        """The store at ``prefix_path`` (Horovod's factory; see the class for the keywords)."""
        return Store(prefix_path, *args, **kwargs)

    def get_runs_path(self) -> str:
        return self.runs_url

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self.runs_url, run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        """Where the run's per-epoch checkpoints are."""
        from .training import checkpoints_of

        return checkpoints_of(self.get_run_path(run_id))

    def get_checkpoint_filename(self) -> str:
        return self.model_filename

    def get_filesystem(self):
        """The fsspec filesystem of the store."""
        from .. import storage

        return storage.filesystem(self.prefix_url, self.storage_options)[0]

    def exists(self, url: str) -> bool:
        from .. import storage

        fs, path = storage.filesystem(url_of(url), self.storage_options)
        return fs.exists(path)

    def read(self, url: str) -> bytes:
        from .. import storage

        fs, path = storage.filesystem(url_of(url), self.storage_options)
        return fs.cat_file(path)

    def without_credentials(self) -> "Store":
        """This store with no ``storage_options`` (what ``save`` writes)."""
        copy = object.__new__(Store)
        copy.__dict__.update(self.__dict__, storage_options={})
        return copy

    def __repr__(self) -> str:
        return f"Store({self.prefix_url!r})"


def url_of(path: str) -> str:
    """A store path as an fsspec URL: a local path becomes an absolute ``file://`` URL, ``dbfs:/x``
    the Databricks mount ``file:///dbfs/x``."""
    if path.startswith("dbfs:/"):
        return "file:///dbfs/" + path[len("dbfs:/"):].lstrip("/")
    if "://" in path:
        return path
    return "file://" + os.path.abspath(os.path.expanduser(path))


def _model_filename(name: str | None) -> str:
    if name is None:
        return "model.keras"
    if not isinstance(name, str) or not name or "/" in name:
        raise InvalidArgumentError(f"checkpoint_filename={name!r} must be a file name such as 'model.keras'")
    base, suffix = os.path.splitext(name)
    if suffix and suffix != ".keras":
        raise InvalidArgumentError(f"checkpoint_filename={name!r}: the trained model is saved whole, as Keras 3 saves "
                                   f"models, in a .keras file: pass checkpoint_filename='{base}.keras'")
    return name if suffix else name + ".keras"
