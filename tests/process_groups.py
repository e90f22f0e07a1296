"""torch.distributed process groups for the tests: this process as one rank
(`process_group`), or several spawned ranks with a deadline whose failures come back
with their tracebacks (`run_ranks`)."""

from __future__ import annotations

import contextlib
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def process_group(
    backend: str = "gloo",
    *,
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    timeout: timedelta | None = None,
) -> Iterator[None]:
    """This process as ``rank`` of a torch.distributed group for the ``with`` block; the group
    is destroyed after it, error or not.

    ``port=None``: a one-rank group on an in-memory store (no socket); otherwise the ranks meet
    at ``tcp://127.0.0.1:<port>``. ``timeout``: how long a collective waits (torch's default
    when None).
    """
    if port is None and world_size != 1:
        raise ValueError(f"a group of {world_size} ranks needs a port to meet at")
    meet = {"store": dist.HashStore()} if port is None else {"init_method": f"tcp://127.0.0.1:{port}"}
    waits = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **meet, **waits)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    collective_timeout: timedelta | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned processes joined in one process group.

    Args:
        fn: a module-level function (spawn imports it by name in each rank).
        world_size: how many ranks (processes).
        *args: passed to ``fn`` after the rank; they must pickle.
        backend: ``"gloo"`` (CPU) or ``"nccl"``, which puts rank r on GPU r.
        timeout: seconds for the whole run; past it every rank is stopped and the test fails
            naming the ranks not done (one left waiting in a collective fails, never hangs).
        collective_timeout: how long a collective waits inside the ranks (torch's default
            when None).

    Returns:
        ``fn``'s return values in rank order (they must pickle).

    Raises:
        The first failing rank's exception, its remote traceback as the cause; the other
        ranks are stopped. RuntimeError when a rank exits without an answer (a crash).
    """
    context = mp.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    answer = (writer, context.Lock())  # one pipe for all ranks: the parent reads answers in the order sent
    group = (backend, world_size, free_port(), collective_timeout)
    ranks = [context.Process(target=_rank_main, args=(rank, group, fn, args, answer)) for rank in range(world_size)]
    try:
        for process in ranks:
            process.start()
        writer.close()
        return _collect(reader, ranks, timeout)
    finally:
        _stop(ranks)
        reader.close()


class RankTraceback(Exception):
    """A rank's traceback, as text: the cause of the exception `run_ranks` re-raises."""

    def __str__(self) -> str:
        return self.args[0]


def _rank_main(rank: int, group: tuple, fn: Callable[..., Any], args: tuple, answer: tuple) -> None:
    backend, world_size, port, collective_timeout = group
    failed = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        with process_group(backend, rank=rank, world_size=world_size, port=port, timeout=collective_timeout):
            try:
                result = fn(rank, *args)
            except BaseException as error:  # said before the group closes and breaks the others' collectives
                failed = True
                _send(answer, (rank, False, _portable(error)))
                raise
        _send(answer, (rank, True, result))
    except BaseException as error:
        if not failed:
            _send(answer, (rank, False, _portable(error)))


def _portable(error: BaseException) -> tuple[bytes | None, str]:
    """``(the pickled exception or None where it does not pickle, its traceback text)``."""
    text = "".join(traceback.format_exception(error))
    try:
        return pickle.dumps(error), text
    except Exception:
        return None, text


def _send(answer: tuple, message: tuple) -> None:
    writer, lock = answer
    try:
        data = pickle.dumps(message)
    except Exception as error:  # a result that does not pickle: the rank fails
        data = pickle.dumps((message[0], False, _portable(error)))
    with lock:
        writer.send_bytes(data)


def _collect(reader, ranks: list, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(ranks):
        waiting = [rank for rank in range(len(ranks)) if rank not in results]
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(
                f"rank(s) {waiting} of {len(ranks)} not done after {timeout} s (one may wait in a collective); "
                "every rank was stopped"
            )
        wait([reader, *(ranks[rank].sentinel for rank in waiting)], timeout=left)
        exited = [rank for rank in waiting if ranks[rank].exitcode is not None]  # before reading: all it sent is there
        while reader.poll():
            rank, ok, payload = pickle.loads(reader.recv_bytes())
            if not ok:
                raise _rank_error(rank, *payload)
            results[rank] = payload
        for rank in exited:
            if rank not in results:
                raise RuntimeError(f"rank {rank} exited with code {ranks[rank].exitcode} without an answer")
    return [results[rank] for rank in range(len(ranks))]


def _rank_error(rank: int, pickled: bytes | None, text: str) -> BaseException:
    """The rank's own exception (a RuntimeError where it does not cross, or would end pytest),
    caused by `RankTraceback`."""
    try:
        error = pickle.loads(pickled) if pickled is not None else None
    except Exception:
        error = None
    if error is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
        error = RuntimeError(f"rank {rank} failed: {text.strip().splitlines()[-1]}")
    error.__cause__ = RankTraceback(f"rank {rank}:\n{text}")
    return error


def _stop(ranks: list) -> None:
    for process in ranks:
        if process.is_alive():
            process.terminate()
    for process in ranks:
        if process.pid is None:
            continue  # never started
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
