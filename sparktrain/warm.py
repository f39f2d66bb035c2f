"""``python -m sparktrain.warm``: import, once, what the driver and every rank import, so that
their bytecode is written where the packages are installed (an install that wrote none, such as
``uv pip install`` without ``--compile-bytecode``). Modules that are not installed are passed over."""
from __future__ import annotations

import importlib
import sys

#: What a run imports: the driver's side, the ranks' framework layer, and what the tests' servers use.
MODULES = ("pyspark.sql", "pyarrow", "pandas", "cloudpickle", "fsspec", "tensorflow", "keras", "tf_keras",
           "sparktrain.keras", "sparktrain.ml", "mlflow", "sklearn.datasets", "adlfs", "s3fs", "jax")


def main() -> int:
    from .tflog import filtered_stderr

    found = []
    with filtered_stderr():  # TensorFlow's start-up lines, as a run hides them
        for name in MODULES:
            try:
                importlib.import_module(name)
                found.append(name)
            except Exception:  # noqa: BLE001 - not installed, or fails here: the run says why when it needs it
                pass
    print(f"sparktrain.warm: imported {', '.join(found)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
