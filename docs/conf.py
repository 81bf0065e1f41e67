"""Sphinx configuration of the documentation site: Markdown pages (MyST) and an API reference generated from the
docstrings (autodoc; napoleon reads their Google-style sections). Build it strictly, as CI does:
``sphinx-build -W --keep-going docs site`` (a warning, such as a broken link or a docstring that does not parse,
fails the build)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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


def _unresolved_in_a_page(app: Any, env: Any, node: Any, contnode: Any) -> None:
    """A ``{py:class}`` link written in a documentation page must resolve (the docstrings on the API page may name
    internals that are not documented there; those are left alone)."""
    from sphinx.util import logging

    docname = getattr(env, "docname", "")
    if node.get("refdomain") == "py" and docname != "reference/api":
        logging.getLogger(__name__).warning(
            "unresolved API link %s: is it on reference/api.md?", node["reftarget"], location=node
        )


def setup(app: Any) -> None:
    app.connect("missing-reference", _unresolved_in_a_page)
