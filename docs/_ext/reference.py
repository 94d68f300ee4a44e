"""Sphinx helpers for cupycomm's API reference.

- Data re-exported under a public name (``cupycomm.DTYPES``, ``cupycomm.DEFAULT_TIMEOUT``,
  ``cupycomm.devices.HOST``...) is documented by the doc-comment where it is defined, not by
  the docstring of its type (autodoc alone would show ``float``'s).
- Every public name (``cupycomm.__all__``, ``cupycomm.devices.__all__``,
  ``cupycomm.testing.__all__``, ``cupycomm.errors.__all__``, ``cupycomm.run.launchers.__all__``,
  ``cupycomm.tools.fieldtest.__all__``, ``cupycomm.tools.selfcheck.__all__``) has an entry in
  the reference:
  a name without one is a warning, so the build (warnings as errors) fails until the
  reference documents it.
"""
import importlib
import pkgutil

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

import cupycomm

LOG = logging.getLogger(__name__)

PUBLIC_MODULES = ("cupycomm", "cupycomm.devices", "cupycomm.testing", "cupycomm.errors",
                  "cupycomm.run.launchers", "cupycomm.tools.fieldtest", "cupycomm.tools.selfcheck")


def public_names():
    """(module, name) of every public name."""
    for module_name in PUBLIC_MODULES:
        for name in importlib.import_module(module_name).__all__:
            yield module_name, name


def _home_doc(name, obj):
    """The doc-comment of the module-level ``name`` bound to ``obj`` where it is defined."""
    for info in pkgutil.walk_packages(cupycomm.__path__, "cupycomm."):
        module = importlib.import_module(info.name)
        if getattr(module, name, None) is obj:
            doc = ModuleAnalyzer.for_module(info.name).find_attr_docs().get(("", name))
            if doc:
                return list(doc)
    return None


def _data_docstring(app, what, name, obj, options, lines):
    if what == "data":
        module_name, _, attr = name.rpartition(".")
        own = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", attr))
        if not own:
            doc = _home_doc(attr, obj)
            if doc is None:
                LOG.warning("%s has no doc-comment where it is defined", name)
            lines[:] = doc or []


def _resolve(dotted):
    """The object a documented name stands for (None for one that is not importable)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def _check_public_names(app, env):
    """Warn for each public name with no entry: under its public name, or (for a function
    or class) under another name of the same object (``cupycomm.prefetch`` is documented as
    ``cupycomm.devices.prefetch``)."""
    domain = env.get_domain("py")
    objects, modules = domain.objects, domain.modules
    documented = {id(_resolve(name)) for name in objects}
    for module_name, name in public_names():
        if f"{module_name}.{name}" in objects or f"{module_name}.{name}" in modules:
            continue
        obj = getattr(importlib.import_module(module_name), name)
        if isinstance(obj, (int, float, str, dict)) or id(obj) not in documented:
            LOG.warning("%s.%s is public but has no entry in the API reference",
                        module_name, name)


def setup(app):
    app.connect("autodoc-process-docstring", _data_docstring)
    app.connect("env-check-consistency", _check_public_names)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
