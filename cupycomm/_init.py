"""``cupycomm.init()``: start cupycomm in this process, in named steps.

1. :func:`_check_arguments`: refuse a bad timeout or device before anything happens;
2. :func:`_current`: the default communicator already made, if it fits the arguments;
3. :func:`_settings`: what the arguments leave unsaid, from the CUPYCOMM_* variables;
4. :func:`_install_process_hooks`: the abort handler, the exit record and the flight
   recorder's signal (each once per process);
5. :func:`_parent`: the MPI communicator to build on, whose ranks must all arrive within
   the timeout (:func:`cupycomm.faults.watchdog.meet`), and which
   ``_bootstrap.check_launch`` holds against the launcher's world (N singletons where it
   started N ranks: an error);
6. the Communicator over a duplicate of it (:meth:`~cupycomm.Communicator.create`);
   or, in a process that ``comm.grow()`` started, the grown communicator
   (:func:`cupycomm.survivors.grow.join`).
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, Optional, Tuple

from mpi4py import MPI

from . import _bootstrap, _env
from .comm.communicator import Communicator
from .faults import abort, flight, watchdog
from .run import exit_records
from .survivors import grow, numbering, policy

__all__ = ["init"]

_default: Optional[Communicator] = None   # init()'s communicator of every rank of the job
_default_made_with: Dict[str, Any] = {}    # its device= and on_peer_loss mode


def init(mpi_comm: Optional[MPI.Comm] = None, *, device: Optional[int] = None,
         timeout: Optional[float] = None, abort_on_exception: Optional[bool] = None,
         debug: Optional[bool] = None, device_module: Any = None,
         on_peer_loss: Optional[str] = None) -> Communicator:
    """Start cupycomm in this process and return a :class:`~cupycomm.Communicator`.

    Args:
        mpi_comm: an mpi4py communicator to build on (it is duplicated: cupycomm's traffic
            never mixes with yours). Default: every rank of the job, and then ``init()`` is
            idempotent: later calls return the same communicator until it is closed.
        device: the CUDA device of this rank; default: local rank modulo the node's GPUs.
        timeout: seconds before a blocked collective is declared hung; ``math.inf``: never
            (default :data:`~cupycomm.DEFAULT_TIMEOUT`, or the CUPYCOMM_TIMEOUT environment
            variable, where ``inf`` means none).
        abort_on_exception: abort the whole MPI job when an exception escapes on any rank
            (default on; CUPYCOMM_ABORT_ON_EXCEPTION=0 turns it off).
        debug: before each collective, check across ranks that every rank calls the same
            collective with matching arguments (default off; CUPYCOMM_DEBUG=1 turns it on).
        device_module: the module that provides device arrays, streams and NCCL; default
            CuPy. The test suite passes its host-memory NCCL stand-in here.
        on_peer_loss: what a lost peer process does, in this process: ``"abort"`` (the
            default) ends the job, naming it; ``"raise"``: collectives raise
            :class:`~cupycomm.errors.PeerLost` on every survivor, which may
            ``comm.shrink()`` and go on. None keeps what an earlier ``init()`` chose.
            "raise" needs Open MPI 5 started with ``mpiexec --with-ft ulfm --mca btl
            tcp,self``; elsewhere it is refused here (RuntimeError, on every rank). See
            :mod:`cupycomm.survivors`. In a process that ``comm.grow()`` started, "raise"
            (None means it there) joins the survivors and returns the grown communicator,
            with their name, timeout and debug mode (:func:`cupycomm.joined_late`).

    Example (2 ranks)::

        from mpi4py import MPI
        comm = cupycomm.init()                  # every rank of the job
        alone = MPI.COMM_WORLD.Split(comm.rank)  # an mpi4py communicator of your own
        with cupycomm.init(alone) as sub:       # built on a duplicate of it
            sub.all_reduce(numpy.ones(2))       # Rank 0: array([1., 1.])  Rank 1: the same
        alone.Free()
    """
    global _default
    _check_arguments(timeout, device)
    if on_peer_loss is not None:
        policy.check_mode(on_peer_loss)
    if mpi_comm is None:
        current = _current(device, timeout, debug, on_peer_loss)
        if current is not None:
            return current
    timeout, debug = _settings(timeout, debug)
    joining = mpi_comm is None and grow.spawned_to_join()
    if joining and on_peer_loss == "abort":   # said to the survivors too, who wait for it
        grow.join(device, device_module, "this process was started by comm.grow() to join "
                                         "ranks that go on after a lost peer; "
                                         "on_peer_loss='abort' cannot be its mode (leave it "
                                         "out, or pass 'raise')")
    if on_peer_loss is not None or joining:
        policy.choose(on_peer_loss or "raise", MPI.Get_library_version())
    _install_process_hooks(abort_on_exception, joining)
    if joining:   # the survivors wait in grow(): their plan, the merge
        grown = grow.join(device, device_module)
        comm = Communicator.create(grown.mpi_comm, name=grown.name, timeout=grown.timeout,
                                   device=grown.device, device_module=device_module,
                                   debug=grown.debug)
        numbering.keep(comm)
    else:
        parent = _parent(mpi_comm)
        if parent.Get_size() > 1:   # the first collective: a rank that never comes ends it
            watchdog.meet(parent, timeout)
        _bootstrap.check_launch(parent)   # N singletons where the launcher started N: an error
        comm = Communicator.create(parent.Dup(),
                                   name="world" if mpi_comm is None else "mpi_comm",
                                   timeout=timeout, device=device,
                                   device_module=device_module, debug=debug)
    if mpi_comm is None:
        _default = comm
        _default_made_with.update(device=grown.device if joining else device,
                                  on_peer_loss="raise" if policy.raising() else "abort")
    return comm


def _check_arguments(timeout: Optional[float], device: Optional[int]) -> None:
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, numbers.Real)):
        raise TypeError(f"init: timeout must be a number of seconds, got {timeout!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"init: timeout must be a positive number of seconds, got {timeout!r}")
    if device is not None and (type(device) is not int or device < 0):
        raise ValueError(f"init: device must be a CUDA device number >= 0, got {device!r}")


def _current(device: Optional[int], timeout: Optional[float], debug: Optional[bool],
             on_peer_loss: Optional[str]) -> Optional[Communicator]:
    """The default communicator if it is open (and was made with the settings asked for:
    else ValueError), or None."""
    if _default is None or _default.closed:
        return None
    asked = {"device": (device, _default_made_with["device"]),
             "timeout": (timeout, _default.timeout), "debug": (debug, _default.debug),
             "on_peer_loss": (on_peer_loss, _default_made_with["on_peer_loss"])}
    for name, (wanted, current) in asked.items():
        if wanted is not None and wanted != current:
            raise ValueError(f"init: already initialized with {name}={current!r}, now "
                             f"asked for {name}={wanted!r}; close() the communicator first")
    return _default


def _settings(timeout: Optional[float], debug: Optional[bool]) -> Tuple[float, bool]:
    """(timeout, debug): the arguments, or else the CUPYCOMM_* variables' values; the
    variables read later, while the communicator is made, are refused now if bad."""
    for name in _env.AT_INIT:
        _env.read(name)
    return (_env.read("CUPYCOMM_TIMEOUT") if timeout is None else timeout,
            _env.read("CUPYCOMM_DEBUG") if debug is None else debug)


def _install_process_hooks(abort_on_exception: Optional[bool], joining: bool) -> None:
    exit_records.start()     # under python -m cupycomm.run: this rank's end will be known
    if abort.abort_enabled(abort_on_exception):   # its hook then comes first (see start())
        abort.install_abort_handler(joining)   # an exception on one rank ends the whole job
    flight.install_signal()  # a signal dumps the flight recorder


def _parent(mpi_comm: Optional[MPI.Comm]) -> MPI.Comm:
    """``mpi_comm``, or every rank of the job; TypeError where it is not a communicator."""
    parent = _bootstrap.world() if mpi_comm is None else mpi_comm
    if not isinstance(parent, MPI.Comm) or parent == MPI.COMM_NULL:
        raise TypeError(f"init: mpi_comm must be an mpi4py communicator, got {parent!r}")
    return parent
