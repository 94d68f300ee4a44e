"""Nested batches: apply a function to the arrays in tuples, lists and dicts, keeping the shape."""
from __future__ import annotations

from typing import Any, Callable, Tuple

__all__ = ["map_arrays", "path_text"]


def map_arrays(tree: Any, fn: Callable[[Any, Tuple], Any], is_array: Callable[[Any], bool],
               path: Tuple = ()) -> Any:
    """``tree`` with each array ``a`` (``is_array(a)``) replaced by ``fn(a, path)``, where
    ``path`` holds the indices and keys leading to it. Tuples (named ones too), lists and
    dicts are rebuilt; anything else is returned as it is."""
    if is_array(tree):
        return fn(tree, path)
    if isinstance(tree, dict):
        return {key: map_arrays(value, fn, is_array, path + (key,)) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [map_arrays(value, fn, is_array, path + (i,)) for i, value in enumerate(tree)]
        if isinstance(tree, list):
            return items
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def path_text(name: str, path: Tuple) -> str:
    """``inputs[1]['x']`` for name ``inputs`` and path ``(1, 'x')``, for messages."""
    return name + "".join(f"[{step!r}]" for step in path)
