"""Sphinx configuration of the documentation site: Markdown pages (MyST) and an API reference generated from the
docstrings (autodoc; napoleon reads their Google-style sections). Build it strictly, as CI does:
``sphinx-build -W --keep-going docs site`` (a warning, such as a broken link or a docstring that does not parse,
fails the build)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning_stability  # noqa: E402

project = "lightning_stability"
release = version = lightning_stability.__version__
copyright = "the lightning_stability authors; Apache License 2.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "stability_report.json", "conf.py"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "lightning_stability"
