"""What a front gives the callbacks: its Keras module and what differs between the fronts (Keras 3 on
TensorFlow, tf_keras, Keras 3 on JAX), as one object, so that the callbacks are written once
(the ``*Impl`` classes, which read ``self.backend``) and built for it (:func:`classes`), as Horovod's callback
implementations take a ``backend``.

:class:`Backend` holds what every front shares, and Keras 3's ways where the lines differ; each front's
subclass says the rest: the collectives (``sparktrain.keras.fronts.on_tensorflow``,
``sparktrain._jax.backend``) and tf_keras' ways (``sparktrain.keras.fronts.tf_keras``). It imports
neither TensorFlow nor JAX.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

from .. import kerasline


class Backend:
    """A front's Keras and collectives, as the callbacks use them."""

    #: Whether each rank's metrics are already the global batch's (keras.distribution reduces them).
    metrics_are_global = False
    #: Whether Keras's own ``keras.distribution`` does the data parallelism (no DistributedOptimizer).
    keras_distribution = False
    #: Whether some variables may stay each rank's own (``local_variables``, ``register_local_var``).
    local_variables = True
    #: Whether Horovod's elastic API (``hvd.elastic``) is served.
    elastic = True

    def __init__(self, keras, line: str):
        #: ``keras`` (Keras 3) or ``tf_keras``.
        self.keras = keras
        #: Its line (``sparktrain.kerasline``), which is also its package's name.
        self.line = line

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.line})"

    # -- the collectives: each front's own ---------------------------------------------------------

    def ready(self) -> None:
        """Make the collectives ready before a callback's first one (``init`` where it is lazy)."""

    def prepare(self, model) -> None:
        """What training ``model`` needs before its first step, beyond the broadcast."""

    def gather_ints(self, value: int) -> list[int]:
        """``value`` from every rank, in rank order."""
        raise NotImplementedError

    def average_floats(self, values: list[float]) -> list[float]:
        """Each of ``values`` averaged over the ranks."""
        raise NotImplementedError

    def broadcast_model(self, model, root_rank: int, with_optimizer: bool, local: dict) -> None:
        """``model``'s variables (and, ``with_optimizer``, its optimizer's) as they are on ``root_rank``,
        except those in ``local`` (by id) and those its optimizer keeps each rank's own."""
        raise NotImplementedError

    # -- what every front shares --------------------------------------------------------------------

    def refuse(self, what: str) -> None:
        """Raise where ``what`` (``sparktrain.keras``'s name) has no meaning on this front."""

    def saving(self) -> ContextManager:
        """Around a save that one rank makes alone."""
        return contextlib.nullcontext()

    def with_weights(self, model, filepath: str, custom_objects=None):
        """``model`` holding the weights saved at ``filepath`` (a ``.keras`` or ``.weights.h5`` file),
        loaded by one rank alone: here ``model`` itself."""
        model.load_weights(filepath)
        return model

    def value(self, x) -> float:
        """A Keras scalar (a variable, a tensor, a number) as a Python float."""
        if isinstance(x, (int, float)):
            return float(x)
        convert = getattr(getattr(self.keras, "ops", None), "convert_to_numpy", None) or self.keras.backend.get_value
        return float(convert(x))

    def requirements(self) -> list[str]:
        """A model's requirements on this front, pinned to this process's versions."""
        import numpy

        return [f"{self.line}=={self.keras.__version__}", *self.backend_requirements(), f"numpy=={numpy.__version__}"]

    def backend_requirements(self) -> list[str]:
        raise NotImplementedError

    # -- Keras 3's ways (tf_keras' front says its own) ---------------------------------------------

    def start_at(self, model, epoch: int) -> None:
        """Make ``model``'s next ``fit`` start at ``epoch``: what Keras 3's own BackupAndRestore sets."""
        model._initial_epoch = epoch

    def clear_start(self, model) -> None:
        model._initial_epoch = None

    def log_model(self, model, **kwargs) -> None:
        """``model`` logged to MLflow's active run, in the flavour of its Keras."""
        import mlflow

        mlflow.keras.log_model(model, **kwargs)


def optimizer_variables(optimizer) -> list:
    """An optimizer's variables: a list on Keras 3, a method on tf_keras' legacy optimizers."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def classes(backend: Backend, impls: list, module: str) -> dict[str, type]:
    """``impls`` (the callbacks' implementations, plain classes) as classes of ``backend``'s Keras, named
    as ``module`` names them (their names less ``Impl``): each subclasses its implementation and the Keras
    ``Callback``, with the backend given, and refuses a model of the other Keras line as soon as ``fit``
    hands it over."""
    base = backend.keras.callbacks.Callback
    out = {}
    for impl in impls:
        name = impl.__name__.removesuffix("Impl")
        cls = type(name, (impl, base), {"backend": backend, "__module__": module, "__qualname__": name,
                                        "__doc__": impl.__doc__})
        cls.set_model = _checked_set_model(cls)
        out[name] = cls
    return out


def _checked_set_model(cls: type):
    def set_model(self, model):
        kerasline.check_same_line(model=model, callback=self)
        super(cls, self).set_model(model)

    return set_model
