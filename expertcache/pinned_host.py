"""Pinning a backing store's host buffer (``cudaHostRegister``) and releasing it safely.

`register` pins an exactly sized buffer *mapped* (GPU kernels may read it through its
device address) and *portable* (every device sees it pinned). `release` unregisters it
once every CUDA device has finished the work queued so far, so a copy still reading the
buffer never reads freed memory; the buffer itself is freed when its last reference goes.

Threading: the wait is a device-wide synchronize. Inside a CUDA graph capture on the
calling thread's current stream no sync is allowed, so the release is deferred to the next
`release` or `flush_released` (a new pinned store calls it). A capture running on *another*
thread cannot be seen from here (torch reports only the current stream's), so a store
released on one thread while another captures a graph in torch's default ``"global"``
capture mode still synchronizes and breaks that capture: release stores outside captures.
"""

from __future__ import annotations

import threading

import torch

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2

#: Buffers whose release came during a CUDA graph capture (no sync is allowed then).
_DEFERRED: list[torch.Tensor] = []
_LOCK = threading.Lock()


def register(buffer: torch.Tensor) -> None:
    """Pin ``buffer`` (1-D uint8 host memory), mapped and portable.

    Raises:
        RuntimeError: ``cudaHostRegister`` refused (the CUDA error number in the message).
    """
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, flags))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.nbytes} bytes failed (cudaError {err})")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def release(buffer: torch.Tensor) -> None:
    """Unregister ``buffer`` once no queued GPU work can still read it (deferred inside a
    capture on this thread's current stream)."""
    _DEFERRED.append(buffer)
    flush_released()


def flush_released() -> None:
    """Unregister the deferred buffers, unless this thread's current stream is capturing.

    Thread-safe: each call takes the buffers deferred before its synchronize, so a buffer
    released by another thread meanwhile waits for that thread's own synchronize."""
    if not _DEFERRED or _capturing():
        return  # synchronising would break a capture: the next release or new store does it
    with _LOCK:
        pending = _DEFERRED[:]
        _DEFERRED.clear()
    try:
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
    except BaseException:
        with _LOCK:
            _DEFERRED.extend(pending)  # still pinned: the next flush tries again
        raise
    for buffer in pending:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
