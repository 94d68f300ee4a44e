"""How parts lie in one buffer: where each starts, the shapes of ``size`` parts joined along
axis 0, and views of a flat buffer shaped as the arrays packed into it."""
from __future__ import annotations

import itertools
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["offsets", "JoinedShapes", "PartShapes", "views_of"]


def offsets(sizes: Sequence[int], base: int = 0) -> List[int]:
    """Where each part starts when parts of ``sizes`` lie end to end from ``base``.

    Example::

        offsets([3, 0, 2])          # [0, 3, 3]
        offsets([8, 8], base=4096)  # [4096, 4104]
    """
    return [base + start for start in itertools.accumulate([0, *sizes[:-1]])] if sizes else []


class _ShapeTable(dict):
    """A shape -> what ``size`` ranks make of it, computed once per shape so that the call
    path only looks it up. At most :attr:`KEEP` shapes are kept (then it starts over), so a
    program whose shapes keep changing does not grow. Each table defines ``compute(shape)``."""

    KEEP = 1024
    compute: Callable[[tuple], Any]   # each table's own method

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __missing__(self, shape: tuple) -> Any:
        if len(self) >= self.KEEP:
            self.clear()
        value = self[shape] = self.compute(shape)
        return value


class JoinedShapes(_ShapeTable):
    """part shape -> the shapes accepted for ``size`` such parts joined along axis 0:
    stacked ``(size, *part)`` first, then concatenated ``(size * part[0], *part[1:])``
    (a 0-d part has only ``(size,)``).

    Example::

        JoinedShapes(4)[(3,)]   # ((4, 3), (12,))
    """

    def compute(self, part: tuple) -> tuple:
        n = self.size
        return ((n,),) if not part else ((n,) + part, (n * part[0],) + part[1:])


class PartShapes(_ShapeTable):
    """whole shape -> the shape of each of ``size`` equal parts along axis 0, or None where
    the leading axis does not split so (a 0-d whole, or one not divisible by ``size``).

    Example::

        PartShapes(4)[(8, 3)]   # (2, 3)
        PartShapes(4)[(6,)]     # None
    """

    def compute(self, whole: tuple) -> Optional[tuple]:
        if not whole or whole[0] % self.size:
            return None
        return (whole[0] // self.size,) + whole[1:]


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
