"""Conformance with the real CuPy: the calls cupycomm makes on the stand-in, recorded as call
shapes (:mod:`shapes`) and replayed on the installed CuPy without a GPU (:mod:`replay`)."""
