"""Sphinx configuration of the documentation site: Markdown pages (MyST) and an API reference generated from the
docstrings (autodoc; napoleon reads their Google-style sections). Build it strictly, as CI does:
``sphinx-build -W --keep-going docs site`` (a warning, such as a broken link or a docstring that does not parse,
fails the build).

The site links to the repository when ``LIGHTNING_STABILITY_REPOSITORY_URL`` is set at build time (for example
``https://github.com/<owner>/lightning_stability``): the repository in the footer, and on GitHub, GitLab or Bitbucket
a "view source" link on each page. Without it (a local build) no repository link is drawn, so none is dead. The
repository files the pages cite (``examples/*.py``, ``benchmarks/README.md``) are copied into the site with the
``{download}`` role, so those links work offline and wherever the site is built."""

from __future__ import annotations

import os
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
html_static_path = ["_static"]
html_css_files = ["custom.css"]  # code blocks written to 120 columns wrap instead of running off the text column

#: the repository's web address, ``LIGHTNING_STABILITY_REPOSITORY_URL``; empty: no repository link is drawn
repository_url = os.environ.get("LIGHTNING_STABILITY_REPOSITORY_URL", "").rstrip("/")
html_theme_options: dict[str, Any] = {}
if repository_url:
    html_theme_options = {"footer_icons": [{"name": "Repository", "url": repository_url, "html": "repository"}]}
if repository_url.startswith(("https://github.com/", "https://gitlab.com/", "https://bitbucket.org/")):
    html_theme_options |= {  # Furo draws "view source" links for these hosts only
        "source_repository": repository_url + "/",
        "source_branch": os.environ.get("LIGHTNING_STABILITY_REPOSITORY_BRANCH", "main"),
        "source_directory": "docs/",
    }


def _unresolved_in_a_page(app: Any, env: Any, node: Any, contnode: Any) -> None:
    """A ``{py:class}`` link written in a documentation page must resolve (the docstrings on the API page may name
    internals that are not documented there; those are left alone)."""
    from sphinx.util import logging

    docname = getattr(env, "docname", "")
    if node.get("refdomain") == "py" and docname != "reference/api":
        logging.getLogger(__name__).warning(
            "unresolved API link %s: is it on reference/api.md?", node["reftarget"], location=node
        )


def _skip_lightning_hooks(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    """A callback's ``:members:`` leave out Lightning's own hooks (``setup``, ``on_fit_start``, ``state_dict``,
    ...): overriding them is how a callback works, and their docstrings are Lightning's, not ours."""
    from lightning.pytorch import Callback

    function = getattr(obj, "fget", obj)
    module = sys.modules.get(getattr(function, "__module__", ""))
    owner = getattr(module, getattr(function, "__qualname__", "").split(".")[0], None)
    if what == "class" and hasattr(Callback, name) and isinstance(owner, type) and issubclass(owner, Callback):
        return True
    return None


def setup(app: Any) -> None:
    app.connect("missing-reference", _unresolved_in_a_page)
    app.connect("autodoc-skip-member", _skip_lightning_hooks)
