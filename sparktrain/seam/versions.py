"""The versions that must agree between the driver and every executor.

cloudpickle ships functions by reference to their modules and by bytecode, so a rank whose
Python, sparktrain, cloudpickle or TensorFlow differs from the driver's fails in confusing
ways (an unpickling error, or a silently different collective). The driver records its
versions in the task spec; each rank compares before it starts anything.
"""
from __future__ import annotations

import sys
from importlib import metadata
from typing import Mapping

#: Packages compared between the driver and the executors, when the driver has them.
PACKAGES = ("sparktrain", "cloudpickle", "tensorflow")


def _package_version(name: str) -> str | None:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    # metadata.version() parses the whole METADATA file as an email message, description and all,
    # on the driver and on every rank of every run; the version is one of the first headers.
    for line in (dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "").splitlines():
        if line.startswith("Version:"):
            return line[len("Version:"):].strip()
        if not line:
            break  # the end of the headers
    return dist.version


def collect() -> dict[str, str | None]:
    """This process's versions, read from package metadata (nothing heavy is imported)."""
    found: dict[str, str | None] = {"python": "%d.%d.%d" % sys.version_info[:3]}
    for name in PACKAGES:
        found[name] = _package_version(name)
    return found


def _comparable(name: str, version: str | None) -> str | None:
    # Pickled bytecode needs the same Python minor version; patch releases are compatible.
    if name == "python" and version:
        return ".".join(version.split(".")[:2])
    return version


def mismatches(driver: Mapping[str, str | None], here: Mapping[str, str | None]) -> list[str]:
    """One readable line per version that differs; packages the driver lacks are not compared.

    >>> mismatches({"python": "3.11.4", "cloudpickle": "3.0.0"}, {"python": "3.11.9", "cloudpickle": "2.2.1"})
    ['cloudpickle: driver 3.0.0, this executor 2.2.1']
    """
    lines = []
    for name, want in driver.items():
        if want is None:
            continue
        have = here.get(name)
        if _comparable(name, want) != _comparable(name, have):
            lines.append(f"{name}: driver {want}, this executor {have or 'not installed'}")
    return lines


#: The oldest releases sparktrain runs with (docs/compatibility.md): Databricks 15.4 LTS ML's.
FLOORS = {"tensorflow": "2.16", "keras": "3.2"}
_FIXES = {"tensorflow": "pip install 'tensorflow>=2.16' (Keras 3 comes with it)",
          "keras": "pip install 'keras>=3.2'; for Keras 2 code, use tf_keras through sparktrain.tensorflow.strategy()"}


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("."):
        digits = "".join(c for c in p if c.isdigit()) if p[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if digits != p:
            break  # '0rc1': the release part ends here
    return tuple(parts)


def below_floor(found: Mapping[str, str | None], names=tuple(FLOORS)) -> list[str]:
    """One line per package of ``names`` in ``found`` older than sparktrain's floor, with the fix;
    packages not installed are not reported.

    >>> below_floor({"tensorflow": "2.15.1", "keras": "2.15.0"})[1]
    "keras 2.15.0 is older than 3.2, the oldest sparktrain supports: pip install 'keras>=3.2'; for Keras 2 code, use tf_keras through sparktrain.tensorflow.strategy()"
    >>> below_floor({"tensorflow": "2.16.0rc0", "keras": "3.2.1"}), below_floor({"keras": None})
    ([], [])
    """
    return [f"{name} {found[name]} is older than {FLOORS[name]}, the oldest sparktrain supports: {_FIXES[name]}"
            for name in names if found.get(name) and _release(found[name]) < _release(FLOORS[name])]


def require_floor(*names: str) -> None:
    """Raise ImportError naming the versions found and the fix where an installed package of
    ``names`` is older than sparktrain's floor (read from package metadata: nothing is imported)."""
    problems = below_floor({name: _package_version(name) for name in names}, names)
    if problems:
        raise ImportError("; ".join(problems))


def require_keras_3() -> None:
    """:func:`require_floor` of Keras, and of TensorFlow with it where Keras is older (Keras 2 runs on
    TensorFlow alone), before anything imports Keras: asking Keras for its backend would import it,
    and TensorFlow with it."""
    if below_floor({"keras": _package_version("keras")}, ("keras",)):
        require_floor("tensorflow", "keras")
