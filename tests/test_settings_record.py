"""The resolved settings are typed frozen records (``sparktrain.settings.record``): their fields are
the settings table's names, checked at import; every setting the package reads off a record is one
of its fields, checked here over the package's source, so a misspelt setting fails a test, not a run."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from sparktrain import settings
from sparktrain.settings import record

ROOT = pathlib.Path(__file__).resolve().parent.parent / "sparktrain"
METHODS = {"origin"}
DRIVER, RANK = "Settings", "RankSettings"


def _kind(node: ast.AST, bound: dict[str, str]) -> str | None:
    """Which record ``node`` is (:data:`DRIVER` or :data:`RANK`), or None: ``cfg.settings`` (or
    ``self.cfg.settings``), a call that returns one (``config.settings_of(...)``,
    ``rank_settings.current()``), or a name bound to one."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.IfExp):
        body, orelse = _kind(node.body, bound), _kind(node.orelse, bound)
        return body if body == orelse else None
    if isinstance(node, ast.Attribute) and node.attr == "settings":
        inner = node.value
        cfg = (isinstance(inner, ast.Name) and inner.id == "cfg") or \
            (isinstance(inner, ast.Attribute) and inner.attr == "cfg")
        return DRIVER if cfg else None
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = func.value if isinstance(func, ast.Attribute) else None
        if name in ("settings_of", "resolve_all"):
            return DRIVER
        if name in ("current", "parse", "load") and isinstance(owner, ast.Name) and owner.id == "rank_settings":
            return RANK
    return None


def _annotated(scope: ast.AST) -> dict[str, str]:
    """The parameters of ``scope`` annotated as a record."""
    bound = {}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for arg in scope.args.args + scope.args.kwonlyargs:
            text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if text.split(".")[-1] in (DRIVER, RANK):
                bound[arg.arg] = text.split(".")[-1]
    return bound


def reads(source: str) -> list[tuple[int, str, str]]:
    """Every ``(line, record, attribute)`` read off a settings record in ``source``, a function at a time."""
    tree = ast.parse(source)
    found = []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        bound = _annotated(scope)
        body = scope.body if isinstance(scope, ast.Module) else [scope]
        for node in (n for part in body for n in ast.walk(part)):
            if isinstance(node, ast.Assign):
                pairs = [(node.targets[0], node.value)]
                if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(node.targets[0].elts, node.value.elts))
                for target, value in pairs:
                    kind = _kind(value, bound)
                    if isinstance(target, ast.Name) and kind is not None:
                        bound[target.id] = kind
        for node in (n for part in body for n in ast.walk(part)):
            kind = _kind(node.value, bound) if isinstance(node, ast.Attribute) else None
            if kind is not None:
                found.append((node.lineno, kind, node.attr))
    return sorted(set(found))


def test_the_records_hold_the_tables_settings_and_are_frozen():
    assert set(record.names(settings.Settings)) == set(settings.SETTINGS)
    assert set(record.names(settings.RankSettings)) == set(settings.READ_IN_RANK)
    values = settings.resolve_all(conf={}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        values.max_attempts = 2
    with pytest.raises(AttributeError):
        values.max_attempt  # noqa: B018 - a misspelt setting is no attribute
    with pytest.raises(KeyError):
        values["max_attempt"]


def test_a_table_and_record_that_drift_apart_fail_at_import(monkeypatch):
    monkeypatch.setitem(settings.SETTINGS, "max_atempts", settings.SETTINGS["max_attempts"])
    with pytest.raises(TypeError, match=r"unknown \[\]|missing \['max_atempts'\]"):
        settings._check_records()


def test_every_setting_read_off_a_record_is_one_of_its_fields():
    fields = {kind: set(record.names(getattr(settings, kind))) | METHODS for kind in (DRIVER, RANK)}
    seen, wrong = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        for line, kind, attr in reads(path.read_text()):
            seen += 1
            if attr not in fields[kind]:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {kind} has no setting {attr}")
    assert wrong == []
    assert seen > 45  # the scan finds the package's reads: the driver's and the ranks'


def test_the_scan_finds_a_misspelt_setting():
    source = ("def f(cfg):\n    values = cfg.settings\n    return values.elastc_url, cfg.settings.lease_timeout\n"
              "def g():\n    return rank_settings.current().tf_kernel, rank_settings.current().max_attempts\n")
    assert reads(source) == [(3, DRIVER, "elastc_url"), (3, DRIVER, "lease_timeout"), (5, RANK, "max_attempts"),
                             (5, RANK, "tf_kernel")]
