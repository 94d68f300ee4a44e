"""The :class:`~cupycomm.Communicator` and its parts: the checks of every argument
(``checks``), the choice of backend by array kind (``route``), the general path of a call
(``general``, ``layouts``, ``shapes``), foreign arrays (``foreign``), subgroups, batches,
coalescing and object collectives. Not a public import path: use ``cupycomm.Communicator``.
"""
