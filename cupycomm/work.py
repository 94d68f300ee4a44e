"""Work: the handle an asynchronous collective (``async_op=True``) returns.

A Work completes when the communication behind it has (MPI requests on the host, CUDA events
on the device; a ``batch()`` block's Work owns several), and keeps the call's arrays alive
until then, so that no memory pool hands their memory to another array while MPI or NCCL
still uses it. ``wait()`` returns the result: on the host it blocks, then finishes the call
(the division of ``op="avg"``); on the device it makes the caller's current stream wait and
returns at once, as torch.distributed does (``synchronize()`` blocks the host instead).
``wait(timeout=s)`` blocks the host for at most ``s`` seconds: past that a device Work aborts
the NCCL communicator and raises :class:`~cupycomm.errors.CollectiveTimeout`, a host Work
ends the job with a report (MPI cannot cancel a collective). A device Work that an abort cut
short (a timeout, a lost peer, NCCL's asynchronous error) raises the cause from ``wait()``
and ``synchronize()`` (PeerLost for a loss) and never completes.
"""
from __future__ import annotations

import abc
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

if TYPE_CHECKING:   # the contract only: the backends import this module
    from .backends import Completion, DeviceCompletion, HostCompletion

__all__ = ["Work", "HostWork", "DeviceWork", "WorkGroup", "poll_until"]


def poll_until(done: Callable[[], bool], timeout: Optional[float] = None,
               check: Callable[[], None] = lambda: None, longest: float = 5e-3) -> bool:
    """Call ``done`` with a growing sleep between calls (50 µs to ``longest`` s), so that
    waiting ranks leave the CPU to the others (a blocking MPI wait spins, and with more ranks
    than cores it takes the CPU from the ranks still working); ``check`` runs between polls
    and may raise. Returns False if ``timeout`` seconds passed first.

    Example::

        poll_until(lambda: MPI.Request.Testall(requests))
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 5e-5
    while not done():
        check()
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, longest)
    return True


def _inside_batch(label: str) -> RuntimeError:
    return RuntimeError(f"{label}: wait() inside its batch() block; the calls of a block "
                        f"start and complete when the block ends")


class Work(abc.ABC):
    """Handle of an asynchronous collective. See the module docstring for the semantics."""

    __slots__ = ("_result", "_keep", "_done", "_owner", "_label")
    _owner: Optional[Completion]   # None for a WorkGroup, which asks its Works

    def __init__(self, result: Any, keep: Sequence[Any], owner: Optional[Completion],
                 label: str) -> None:
        self._result = result
        self._keep = keep      # arrays that must outlive the communication
        self._done = False
        self._owner = owner    # the backend: reports timeouts and asynchronous errors
        self._label = label    # "all_reduce #12", for messages

    def is_completed(self) -> bool:
        """True once the communication has completed; never blocks."""
        if not self._done and self._test():
            self._complete()
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Complete the call (see the module docstring) and return its result."""
        if not self._done:
            if timeout is None:
                self._wait()
            else:
                self._wait_for(timeout)
        return self._result

    def synchronize(self, timeout: Optional[float] = None) -> Any:
        """Block the host until the communication has completed; return the result."""
        if not self._done:
            self._wait_for(timeout)
        return self._result

    def _wait_for(self, timeout: Optional[float]) -> None:
        owner = self._owner
        assert owner is not None, "a WorkGroup waits through its Works"
        # (poll_until gives up only at a timeout)
        check = functools.partial(owner.check_errors, self._label)
        if not poll_until(self._test, timeout, check) and timeout is not None:
            owner.expired(self._label, timeout)
        self._complete()

    def _complete(self) -> None:
        self._done = True
        self._keep = ()

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<{type(self).__name__} {self._label} {state}>"

    @abc.abstractmethod
    def _test(self) -> bool:
        """Whether the communication has completed, without blocking."""

    @abc.abstractmethod
    def _wait(self) -> None:
        """Wait in the backend's own way (see the module docstring)."""


class HostWork(Work):
    """Work of the MPI backend: nonblocking MPI requests, then an optional finishing step.
    ``requests`` is None for a call queued in a batch() block that has not ended."""

    __slots__ = ("_requests", "_finish")
    _owner: HostCompletion

    # Made and waited for once per async_op call: so that the host's call path stays short,
    # these set and clear Work's fields themselves, and wait() is one frame and the backend's
    # wait_all, where a super() call would cost each one more. The copy is measured: with
    # super().__init__ here, cupycomm's own cost of all_reduce(async_op=True).wait() over
    # Iallreduce().Wait() went from +1.43 to +1.70 µs (one process, 8 B, best of 300 rounds;
    # making a HostWork: 0.22 µs copied, 0.38 with super(), 0.28 with Work.__init__(self)).
    def __init__(self, requests: Optional[List[Any]], result: Any, keep: Sequence[Any],
                 owner: HostCompletion, label: str,
                 finish: Optional[Callable[[], None]] = None) -> None:
        self._result = result
        self._keep = keep
        self._done = False
        self._owner = owner
        self._label = label
        self._requests = requests
        self._finish = finish

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._done:
            if timeout is not None or self._requests is None:
                return super().wait(timeout)
            self._owner.wait_all(self._requests, self._label)
            self._complete()
        return self._result

    def _test(self) -> bool:
        return self._requests is not None and self._owner.test_all(self._requests)

    def _wait(self) -> None:
        if self._requests is None:
            raise _inside_batch(self._label)
        self._owner.wait_all(self._requests, self._label)
        self._complete()

    def _complete(self) -> None:
        finish = self._finish
        if finish is not None:
            self._finish = None
            finish()
        self._done = True
        self._keep = ()


class DeviceWork(Work):
    """Work of the NCCL backend: a CUDA event recorded after the collective on its stream.

    ``captured``: the collective was captured in a CUDA graph; its event is a graph node,
    which CUDA forbids querying: such a Work completes when ``wait()`` (in the capture) joins
    it, and cannot be synchronized. ``number``: the collective's number (its ``seq``) where
    the event is this Work's alone (not a batch() block's; else 0), so the backend may
    record it again for another Work once this one has completed, and an abort that cuts
    it short can name it.
    """

    __slots__ = ("_event", "_captured", "_number")
    _owner: DeviceCompletion

    # Made and waited for once per async_op call: as HostWork's, these set and clear Work's
    # fields themselves, and wait() is one frame and the backend's stream_wait.
    def __init__(self, event: Any, result: Any, keep: Sequence[Any], owner: DeviceCompletion,
                 label: str, captured: bool = False, number: int = 0) -> None:
        self._result = result
        self._keep = keep
        self._done = False
        self._owner = owner
        self._label = label
        self._event = event
        self._captured = captured
        self._number = number

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._done:
            event = self._event
            if timeout is not None or event is None:
                return super().wait(timeout)
            captured = self._captured
            self._owner.stream_wait(event, captured, self._label)
            if captured or event.done:
                self._done = True
                self._keep = ()
        return self._result

    def _test(self) -> bool:
        # No event yet: a call inside a batch() block that has not ended.
        return self._event is not None and not self._captured and self._event.done

    def _wait(self) -> None:
        if self._event is None:
            raise _inside_batch(self._label)
        # Order the caller's stream after the collective; the host does not block.
        self._owner.stream_wait(self._event, self._captured, self._label)
        if self._captured or self._event.done:
            self._complete()

    def _wait_for(self, timeout: Optional[float]) -> None:
        if self._captured:
            raise RuntimeError(f"{self._label}: a collective captured in a CUDA graph runs "
                               f"when the graph is launched: wait() for it in the capture, "
                               f"synchronize the stream that launches the graph")
        super()._wait_for(timeout)


class WorkGroup(Work):
    """Several Works as one (the buffers of a coalesced all-reduce, a bucket's dtypes).

    ``wait``/``synchronize`` apply to each in turn within one overall timeout; ``finish``
    (copying coalesced results back into their arrays) runs once, after all have waited.
    """

    __slots__ = ("_works", "_finish")

    def __init__(self, works: List[Work], result: Any, label: str,
                 finish: Optional[Callable[[], None]] = None) -> None:
        super().__init__(result, (), None, label)
        self._works = works
        self._finish = finish

    def _each(self, method: str, timeout: Optional[float]) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._done:
            for work in self._works:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                getattr(work, method)(left)
            self._complete()
        return self._result

    def wait(self, timeout: Optional[float] = None) -> Any:
        return self._each("wait", timeout)

    def synchronize(self, timeout: Optional[float] = None) -> Any:
        return self._each("synchronize", timeout)

    def _complete(self) -> None:
        if self._finish is not None:
            self._finish()
            self._finish = None
        super()._complete()

    def _test(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def _wait(self) -> None:
        self.wait()
