"""Writes the settings table and the env-contract table from the code before Sphinx reads the pages.

``settings.md`` and ``env-contract.md`` include the files this writes, so the tables cannot
drift from ``sparktrain.settings.SETTINGS`` and ``sparktrain.seam.worker_env.CONTRACT``.
"""
from __future__ import annotations

import os


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(setting) -> str:
    if setting.default is None:
        return "none"
    if isinstance(setting.default, bool):
        return "true" if setting.default else "false"
    if isinstance(setting.default, float) and setting.default.is_integer():
        return f"{int(setting.default)}"
    return str(setting.default)


def settings_table() -> str:
    from sparktrain import settings

    rows = ["| setting | environment variable | Spark conf | default | read in | what it does |",
            "|---|---|---|---|---|---|"]
    for s in settings.SETTINGS.values():
        conf = f"`{s.conf}`" if s.conf else "(none: read in the rank; pass it with `env=`)"
        rows.append(f"| `{s.name}` | `{s.env}` | {conf} | `{_default(s)}` | {s.read_in} | {_cell(s.doc)} |")
    return "\n".join(rows) + "\n"


def env_table() -> str:
    from sparktrain.seam import worker_env

    rows = ["| variable | value |", "|---|---|"]
    for names, meaning in worker_env.CONTRACT:
        rows.append(f"| {', '.join(f'`{n}`' for n in names)} | {_cell(meaning).replace('``', '`')} |")
    return "\n".join(rows) + "\n"


def write_tables(app) -> None:
    out = os.path.join(app.srcdir, "_generated")
    os.makedirs(out, exist_ok=True)
    for name, text in (("settings-table.md", settings_table()), ("env-table.md", env_table())):
        path = os.path.join(out, name)
        old = open(path).read() if os.path.exists(path) else None
        if old != text:  # unchanged files keep their mtime, so Sphinx does not rebuild for nothing
            with open(path, "w") as f:
                f.write(text)


def setup(app):
    app.connect("builder-inited", write_tables)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
