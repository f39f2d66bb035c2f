"""What the broadcast callback does on Keras 3's JAX backend (``backend.JaxBackend``), through the native
engine on host numpy arrays (``collectives``). No TensorFlow is imported here."""
from __future__ import annotations

from . import collectives


def broadcast_variables(variables: list, root_rank: int) -> None:
    """Assign to each of ``variables`` (Keras variables) its value on ``root_rank``."""
    import numpy as np

    variables = list(variables)
    if not variables:
        return
    values = collectives.broadcast_arrays([np.asarray(v.value) for v in variables], root_rank)
    for v, value in zip(variables, values):
        v.assign(value)


def broadcast_model(model, root_rank: int, with_optimizer: bool) -> None:
    """``model``'s variables (and, ``with_optimizer``, its optimizer's) as they are on ``root_rank``.

    Inside ``fit``, Keras on JAX keeps the training state apart from the variables between steps;
    it is written back first, and the next step reads the broadcast values back from them. The
    optimizer's accumulated gradients (``backward_passes_per_step``) stay each rank's own.
    """
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if with_optimizer and optimizer is not None:
        # Gradients accumulated between updates are each rank's own until the update reduces them.
        own = {id(v) for v in getattr(optimizer, "_accumulated_gradients", None) or ()}
        variables += [v for v in optimizer.variables if id(v) not in own]
    broadcast_variables(variables, root_rank)

