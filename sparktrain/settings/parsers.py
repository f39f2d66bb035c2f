"""How a setting's value is parsed, from an argument, an environment variable or a Spark conf
value: each parser takes the name to blame and the value, and returns it parsed or raises
``InvalidArgumentError`` naming both and the fix. Pure.
"""
from __future__ import annotations

import math
import os
from typing import Any

from ..errors import InvalidArgumentError


def parse_seconds(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """A positive, finite number of seconds; echoes the bad value otherwise."""
    if value is None and allow_none:
        return None
    given = value
    if isinstance(value, str):
        try:
            value = float(value.strip().removesuffix("s"))
        except ValueError:
            raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {given!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        hint = " (use None for no limit)" if allow_none else ""
        raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {given!r}{hint}")
    return float(value)


def parse_seconds_or_off(name: str, value: Any) -> float:
    """A positive number of seconds, or 0 for off."""
    if (type(value) in (int, float) and value == 0) or (isinstance(value, str) and value.strip().lower() in
                                                         ("0", "0s", "0.0", "off")):
        return 0.0
    try:
        return parse_seconds(name, value)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{e}; 0 turns it off") from None


def parse_spin(name: str, value: Any) -> str | float:
    """``"auto"``, or a number of seconds from 0 to 1 (how long a collective's wait spins)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    given = value
    if isinstance(value, str):
        try:
            value = float(value.strip().removesuffix("s"))
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidArgumentError(f"{name} must be 'auto' or a number of seconds from 0 to 1 (0.002 spins 2 ms; "
                                   f"0 sleeps at once), got {given!r}")
    return float(value)


def parse_positive_int(name: str, value: Any) -> int:
    """A whole number of at least 1; echoes the bad value otherwise."""
    given = value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a whole number of at least 1, got {given!r}")
    return value


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes_or_auto(name: str, value: Any) -> int | str:
    """``"auto"``, or a size in bytes: a whole number, or one with a unit (``512m``, ``20g``, ``1.5t``;
    ``kb``/``mb``/``gb``/``tb`` and ``KiB``-style spellings too), at least 0.

    >>> parse_bytes_or_auto("n", "20g"), parse_bytes_or_auto("n", 1024), parse_bytes_or_auto("n", "auto")
    (21474836480, 1024, 'auto')
    """
    return _bytes(name, value, True)


def parse_bytes(name: str, value: Any) -> int:
    """A size in bytes, as :func:`parse_bytes_or_auto` reads one, without ``"auto"``.

    >>> parse_bytes("n", "25m"), parse_bytes("n", 0)
    (26214400, 0)
    """
    return _bytes(name, value, False)


def _bytes(name: str, value: Any, auto: bool) -> int | str:
    given = value
    if isinstance(value, str):
        text = value.strip().lower().replace("ib", "").rstrip("b")
        if text == "auto" and auto:
            return "auto"
        number, unit = text.rstrip("kmgt"), text[len(text.rstrip("kmgt")):]
        try:
            value = int(float(number) * _UNITS[unit]) if number and len(unit) <= 1 else None
        except (ValueError, KeyError):
            value = None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        either = "'auto' or " if auto else ""
        raise InvalidArgumentError(f"{name} must be {either}a size in bytes such as 20g, 512m or 1073741824; "
                                   f"got {given!r}")
    return value


def parse_path(name: str, value: Any) -> str:
    """A file path (not empty).

    >>> parse_path("n", "/tmp/trace.json")
    '/tmp/trace.json'
    """
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise InvalidArgumentError(f"{name} must be a file path, got {value!r}")
    return os.fspath(value)


def parse_gc_threshold(name: str, value: Any) -> str:
    """``"python"``, or three whole numbers for ``gc.set_threshold``, as ``"700,10,100"``.

    >>> parse_gc_threshold("gc_threshold", (700, 10, 100))
    '700,10,100'
    """
    if isinstance(value, str) and value.strip().lower() == "python":
        return "python"
    parts = value.split(",") if isinstance(value, str) else value
    try:
        counts = [int(p.strip()) if isinstance(p, str) else p for p in parts]
    except (TypeError, ValueError):
        counts = None
    if (not counts or len(counts) != 3 or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)
            or counts[0] == 0):
        raise InvalidArgumentError(f"{name} must be three whole numbers as gc.set_threshold takes them, the first "
                                   f"above 0 ('700,10,100'), or 'python' for Python's own; got {value!r}")
    return ",".join(str(c) for c in counts)


def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise InvalidArgumentError(f"{name} must be true or false, got {value!r}")


def parse_legacy_keras(name: str, value: Any) -> bool:
    """``TF_USE_LEGACY_KERAS`` read exactly as TensorFlow reads it (``1``, ``true``, ``True``: tf_keras),
    its off values (``0``, ``false``, ``False``, empty) too; any other value is refused, since
    TensorFlow would serve Keras 3 to this driver where the ranks were asked for tf_keras."""
    from ..kerasline import LEGACY_OFF, LEGACY_ON

    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip() in LEGACY_ON:
        return True
    if isinstance(value, str) and value.strip() in LEGACY_OFF:
        return False
    raise InvalidArgumentError(
        f"{name}={value!r}: TensorFlow reads only {', '.join(LEGACY_ON)} as tf_keras (Keras 2) and any other value "
        f"as Keras 3, so this driver and the ranks would serve different Keras lines. Set it to 1 for tf_keras, "
        f"or 0 (or unset it) for Keras 3")


def url(name: str, value: Any) -> str:
    """An fsspec URL, or "" for "none" (turned off)."""
    if isinstance(value, str) and value.strip().lower() in ("none", "off"):
        return ""
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"{name} must be an fsspec URL such as abfss://container@account.dfs.core.windows.net/"
                                   f"tmp or s3://bucket/tmp, got {value!r}")
    return value.strip()


def choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value.strip().lower()
