"""What wraps one ``prepare``: one caller at a time, and no interrupt half-way through a commit.

* `SingleCaller`: a slot pool serves one call at a time. A second thread entering while a
  call is in flight gets `ConcurrentUseError` at once (serialising would not make it
  correct: the first call's slots may be overwritten by the second call before the first
  call's kernels read them; see `ExpertWeightResult`).
* `deferred_interrupts`: ``SIGINT`` arriving inside the block is held and re-raised as
  ``KeyboardInterrupt`` when the block ends, so a Ctrl-C can never land between "copies
  enqueued" and "tables committed". Exceptions raised by the code inside still propagate
  at once (the caller rolls back). Only the main thread receives signals; elsewhere the
  block is a no-op. So it is under a ``SIGINT`` handler installed from C (an application
  embedding Python; `signal.getsignal` gives None): Python could not put such a handler back,
  and it cannot raise in the Python code inside, so it is left in place and keeps its signals.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from expertcache.errors import ConcurrentUseError


class SingleCaller:
    """A non-blocking lock: entering while another thread is inside raises."""

    def __init__(self, what: str) -> None:
        self._lock = threading.Lock()
        self._what = what
        self._holder: int | None = None

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            if self._holder == threading.get_ident():
                raise ConcurrentUseError(
                    f"prepare() was called on {self._what} from inside one of its own prepare() calls (a copy "
                    f"hook?); a pool serves one call at a time"
                )
            raise ConcurrentUseError(
                f"{self._what} is already serving a prepare() call in another thread; a slot pool serves "
                f"one thread at a time (its results stay valid only until the pool's next prepare)"
            )
        self._holder = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._holder = None
        self._lock.release()


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold ``SIGINT`` until the block ends (main thread, under a handler set from Python)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    received: list[object] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and previous != signal.SIG_IGN:
            if callable(previous):
                previous(signal.SIGINT, received[0])  # type: ignore[arg-type]
            else:
                raise KeyboardInterrupt
