"""Sphinx configuration for sparktrain's docs: Markdown pages (MyST) and an API reference from the docstrings."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's sparktrain, not an installed copy
sys.path.insert(0, os.path.join(HERE, "_ext"))

project = "sparktrain"
author = "the sparktrain authors"
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "contract_tables",
    "short_fields",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_generated"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False  # Keras's own callback docstrings are not ours to render
napoleon_google_docstring = False
napoleon_numpy_docstring = True
html_theme = "alabaster"
# Docstrings name parameters with NumPy-style types that are not all documented objects.
nitpicky = False
suppress_warnings = ["myst.header"]
