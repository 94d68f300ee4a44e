"""How parts lie in one buffer: where each starts, the shapes of ``size`` parts joined along
axis 0, and views of a flat buffer shaped as the arrays packed into it."""
from __future__ import annotations

import itertools
from typing import Any, List, Sequence

__all__ = ["offsets", "JoinedShapes", "views_of"]


def offsets(sizes: Sequence[int], base: int = 0) -> List[int]:
    """Where each part starts when parts of ``sizes`` lie end to end from ``base``.

    Example::

        offsets([3, 0, 2])          # [0, 3, 3]
        offsets([8, 8], base=4096)  # [4096, 4104]
    """
    return [base + start for start in itertools.accumulate([0, *sizes[:-1]])] if sizes else []


class JoinedShapes(dict):
    """part shape -> the shapes accepted for ``size`` such parts joined along axis 0:
    stacked ``(size, *part)`` first, then concatenated ``(size * part[0], *part[1:])``
    (a 0-d part has only ``(size,)``).

    Computed once per part shape: the call path only looks them up. At most :attr:`KEEP`
    shapes are kept (then it starts over), so a program whose shapes keep changing does not
    grow.

    Example::

        JoinedShapes(4)[(3,)]   # ((4, 3), (12,))
    """

    KEEP = 1024

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __missing__(self, part: tuple) -> tuple:
        if len(self) >= self.KEEP:
            self.clear()
        n = self.size
        shapes = ((n,),) if not part else ((n,) + part, (n * part[0],) + part[1:])
        self[part] = shapes
        return shapes


def views_of(flat: Any, members: Sequence[Any]) -> List[Any]:
    """Consecutive views of the 1-d ``flat``, shaped as ``members`` one after another.

    Example::

        views_of(numpy.arange(5), [numpy.empty(2), numpy.empty((1, 3))])
        # [array([0, 1]), array([[2, 3, 4]])]
    """
    views, start = [], 0
    for member in members:
        stop = start + member.size
        views.append(flat[start:stop].reshape(member.shape))
        start = stop
    return views
