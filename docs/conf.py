"""Sphinx configuration of cupycomm's documentation (build: ``bash docs/build.sh``).

The pages are Markdown (MyST), so that they read the same on GitHub; the API reference is
generated from the docstrings by autodoc (Google-style sections through napoleon).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

import cupycomm  # noqa: E402  (the installed package: the docs describe what users import)

project = "cupycomm"
author = "The cupycomm developers"
copyright = "the cupycomm developers"   # noqa: A001  (Sphinx's name)
release = version = cupycomm.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "reference",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3          # links to a page's section: [text](page.md#section-title)
myst_enable_extensions = ["colon_fence"]

# Warnings are errors (build.sh passes -W): every cross-reference must resolve.
nitpicky = True
nitpick_ignore_regex = [
    # Names of other libraries (no intersphinx: the build must not need the network).
    ("py:class", r"(numpy|np|cupy|mpi4py|MPI|pytest|_pytest|concurrent|collections|typing)\..*"),
    ("py:class", r"(MPI\.Comm|Any|Iterator|Iterable|Callable|Sequence|Mapping|Optional)"),
    ("py:class", r"(enum\.Enum|abc\.ABC)"),
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"cupycomm {release}"
