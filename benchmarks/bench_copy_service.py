"""Can the copy engine serve copies that the GPU plans, inside a CUDA graph?

Device mode's copy kernel reads mapped pinned memory with the SMs at 0.89-0.93 of the copy
engine (`bench_sm_reads.py`): the plan is on the GPU, and no host can hand the copy engine
addresses it does not know. This experiment measures a way around that, a *copy service*:

    graph:  post kernel   plan -> a mailbox in mapped pinned memory (system-scope release)
            wait          until the service says the layer's copies have landed
    host:   service thread polls the mailboxes, issues the copies on a copy stream
            (cuMemcpyHtoDAsync, the copy engine), then writes the layer's flag there
            (cuStreamWriteValue32, ordered after the copies)

and two ways to wait on the GPU: a one-program spin kernel on the flag ("spin"), or a
captured cuStreamWaitValue32 node ("wait-value"). Variants on the same plans, side by side
(``L`` layers a step, ``M`` missed experts a layer, each a new random plan per step):

    kernel          copy_experts, device mode's mover (SMs read mapped memory)
    engine fixed    the same number of copies captured as memcpy nodes with fixed addresses:
                    the copy engine's ceiling in a graph (not a cache: it replays one plan)
    service spin    the copy service, spin-kernel wait
    service wait    the copy service, cuStreamWaitValue32 wait
    engine switch   (``--switch``) conditional SWITCH nodes pick each miss's expert on the GPU,
                    the copy engine copies it into a staging buffer, a kernel moves that into
                    the slot (`_switch_copies.py`); "chain": a layer's switches one after
                    another, "parallel": side by side; "no move": the copies left in staging
                    (what the move into the slot costs)
    (each also over a store on transparent huge pages, ``--huge-pages``)

Physical bound: bytes / the copy engine's measured pinned bandwidth (one 256 MiB copy).
The service thread polls in Python, holding the GIL: the script sets the interpreter's
switch interval to 0.1 ms so the timing thread gets it back quickly (an engine's own host
loop would compete with such a thread the same way).

    python benchmarks/bench_copy_service.py [--layers 12] [--misses 1 2 4 8]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import threading
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _switch_copies  # noqa: E402
from _common import append_csv, cuda_time_ms, pinned_copy_gbps, print_table  # noqa: E402

from expertcache.kernels.copy_experts import (  # noqa: E402
    DEFAULT_BLOCK,
    CopyPlan,
    MappedHostPointer,
    build_segments,
    copy_experts,
)

# Qwen3-30B-A3B expert: gate_up [2I, H] and down [H, I], bf16 (9.44 MB)
HIDDEN, INTERMEDIATE, EXPERTS, SLOTS = 2048, 768, 128, 64
NAME_BYTES = (2 * INTERMEDIATE * HIDDEN * 2, HIDDEN * INTERMEDIATE * 2)
MAX_COPIES = 64  # plan entries a layer's mailbox holds (at most SLOTS)
SPIN_LIMIT = 1 << 22  # a spin kernel gives up after this many polls (no hang if the service fails)


@triton.jit
def _post_plan(plan_ptr, mailbox_ptr, counter_ptr, MAX: tl.constexpr):
    """Copy a layer's plan ``[count, e0, s0, e1, s1, ...]`` into its host mailbox, then
    publish a new sequence number (system scope, after the entries)."""
    lanes = tl.arange(0, 2 * MAX)
    count = tl.load(plan_ptr)
    entries = tl.load(plan_ptr + 1 + lanes, mask=lanes < 2 * count, other=-1)
    tl.store(mailbox_ptr + 2 + lanes, entries)
    tl.store(mailbox_ptr + 1, count)
    one = tl.arange(0, 1)
    sequence = tl.load(counter_ptr + one) + 1
    tl.store(counter_ptr + one, sequence)
    tl.debug_barrier()  # every thread's entries written, then a system-scope fence, then the number
    published = tl.inline_asm_elementwise(
        "fence.acq_rel.sys;\n mov.b32 $0, $1;", "=r,r", [sequence], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.store(mailbox_ptr + one, published)


@triton.jit
def _spin_until(flag_ptr, counter_ptr, failed_ptr, LIMIT: tl.constexpr):
    """Wait until the service wrote this layer's sequence number into its flag."""
    target = tl.load(counter_ptr)
    seen = tl.load(flag_ptr, volatile=True)
    polls = 0
    while (seen != target) & (polls < LIMIT):
        seen = tl.load(flag_ptr, volatile=True)
        polls += 1
    if seen != target:
        tl.atomic_add(failed_ptr, 1)


class Driver:
    """The few CUDA driver calls the service needs, through ctypes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.memcpy = self._function("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t])
        self.write_value = self._function("cuStreamWriteValue32_v2", [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])
        self.wait_value = self._function("cuStreamWaitValue32_v2", [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])

    def _function(self, name: str, head: list):
        function = getattr(self.lib, name)
        if name.startswith("cuStream"):
            function.argtypes = [ctypes.c_void_p, *head]
        else:
            function.argtypes = [*head, ctypes.c_void_p]
        function.restype = ctypes.c_int
        return function


class CopyService(threading.Thread):
    """Polls each layer's mailbox in turn; copies its plan with the copy engine; signals."""

    def __init__(self, driver: Driver, mailbox: torch.Tensor, routes, flags: torch.Tensor, stream, value_of):
        super().__init__(daemon=True)
        self.driver, self.box, self.routes, self.flags = driver, mailbox.numpy(), routes, flags
        self.stream, self.value_of = ctypes.c_void_p(stream.cuda_stream), value_of
        self.stop = False
        self.errors: list[str] = []
        self.device = torch.cuda.current_device()

    def run(self) -> None:
        torch.cuda.set_device(self.device)
        last = [int(self.box[layer, 0]) for layer in range(self.box.shape[0])]
        while not self.stop:
            for layer in range(self.box.shape[0]):
                while int(self.box[layer, 0]) == last[layer]:
                    if self.stop:
                        return
                last[layer] = int(self.box[layer, 0])
                count = int(self.box[layer, 1])
                for rank in range(count):
                    expert, slot = int(self.box[layer, 2 + 2 * rank]), int(self.box[layer, 3 + 2 * rank])
                    for target, source, nbytes in self.routes:
                        error = self.driver.memcpy(
                            target + slot * nbytes, source + expert * nbytes, nbytes, self.stream
                        )
                        if error:
                            self.errors.append(f"memcpy {error}")
                flag = self.flags[layer].data_ptr()
                error = self.driver.write_value(self.stream, flag, self.value_of(last[layer]), 0)
                if error:
                    self.errors.append(f"write_value {error}")


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """Anonymous memory advised onto transparent huge pages (2 MiB), as a uint8 tensor."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(region, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    tensor._region = region  # type: ignore[attr-defined]  # keep the mapping alive
    return tensor


def make_store(huge: bool) -> torch.Tensor:
    nbytes = EXPERTS * sum(NAME_BYTES)
    if not huge:
        store = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    else:
        store = huge_page_buffer(nbytes)
        error = int(torch.cuda.cudart().cudaHostRegister(store.data_ptr(), nbytes, 1 | 2))
        if error:
            raise RuntimeError(f"cudaHostRegister failed ({error})")
    store.view(torch.int32).random_()
    return store


def random_plans(steps: int, layers: int, misses: int, gen: torch.Generator) -> torch.Tensor:
    """``[steps, layers, 1 + 2 MAX]`` int32 plans: count, then (expert, slot) pairs, distinct."""
    plans = torch.full((steps, layers, 1 + 2 * MAX_COPIES), -1, dtype=torch.int32)
    plans[..., 0] = misses
    for step in range(steps):
        for layer in range(layers):
            experts = torch.randperm(EXPERTS, generator=gen)[:misses]
            slots = torch.randperm(SLOTS, generator=gen)[:misses]
            plans[step, layer, 1 : 1 + 2 * misses : 2] = experts.int()
            plans[step, layer, 2 : 2 + 2 * misses : 2] = slots.int()
    return plans


def measure(
    store: torch.Tensor, layers: int, misses: int, repeats: int, label: str, switch: bool = False
) -> list[dict]:
    driver = Driver()
    slots = [torch.empty(SLOTS, nbytes // 2, dtype=torch.bfloat16, device="cuda") for nbytes in NAME_BYTES]
    offsets = (0, EXPERTS * NAME_BYTES[0])
    segments = build_segments(offsets, NAME_BYTES, 4, DEFAULT_BLOCK)
    routes = [(slot.data_ptr(), store.data_ptr() + offset, nbytes)
              for slot, offset, nbytes in zip(slots, offsets, NAME_BYTES, strict=True)]  # fmt: skip
    host_plans = random_plans(repeats + 8, layers, misses, torch.Generator().manual_seed(misses)).pin_memory()
    plan = torch.empty(host_plans.shape[1:], dtype=torch.int32, device="cuda")
    step_of = iter(range(10**9))
    byte_slots = [slot.view(torch.uint8).view(-1) for slot in slots]

    def load_plan():
        plan.copy_(host_plans[next(step_of) % host_plans.shape[0]], non_blocking=True)

    rows = []

    def timed(name: str, graph: torch.cuda.CUDAGraph) -> None:
        def one():
            load_plan()
            graph.replay()

        ms = cuda_time_ms(one, repeats=repeats)
        nbytes = layers * misses * sum(NAME_BYTES)
        rows.append({"store": label, "misses": misses, "variant": name, "ms": ms, "gbps": nbytes / ms / 1e6})
        if name != "engine fixed" and not name.endswith("no move"):  # the last layer's copies landed in their slots
            torch.cuda.synchronize()
            last = plan[-1].cpu()
            last = [(int(last[1 + 2 * r]), int(last[2 + 2 * r])) for r in range(misses)]
            rows[-1]["equal"] = all(
                torch.equal(target[slot * nbytes : (slot + 1) * nbytes].cpu(),
                            store[offset + expert * nbytes : offset + (expert + 1) * nbytes])
                for expert, slot in last
                for target, offset, nbytes in zip(byte_slots, offsets, NAME_BYTES, strict=True)
            )  # fmt: skip

    def capture(enqueue, warm: bool = True) -> torch.cuda.CUDAGraph:
        load_plan()
        if warm:  # an eager pass first (the switch copies exist only in a graph)
            enqueue()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            enqueue()
        return graph

    flat = store

    def kernel_step():
        for layer in range(layers):
            copy_experts(flat, slots, CopyPlan(plan[layer, :1], plan[layer, 1:], plan[layer, 2:], 2), segments,
                         unit=4, num_experts=EXPERTS)  # fmt: skip

    timed("kernel", capture(kernel_step))

    fixed = host_plans[0]

    def engine_fixed_step():
        for layer in range(layers):
            for rank in range(misses):
                expert, slot = int(fixed[layer, 1 + 2 * rank]), int(fixed[layer, 2 + 2 * rank])
                for target, offset, nbytes in zip(byte_slots, offsets, NAME_BYTES, strict=True):
                    source = store[offset + expert * nbytes : offset + (expert + 1) * nbytes]
                    target[slot * nbytes : (slot + 1) * nbytes].copy_(source, non_blocking=True)

    timed("engine fixed", capture(engine_fixed_step))

    for chained, move in ((True, True), (False, True), (False, False)) if switch else ():
        started = time.perf_counter()
        copies = _switch_copies.SwitchCopies(store, offsets, NAME_BYTES, slots, EXPERTS, misses, chained, move)
        graph = capture(lambda copies=copies: [copies.enqueue(plan[layer]) for layer in range(layers)], warm=False)
        built_s = time.perf_counter() - started
        timed(f"engine switch {'chain' if chained else 'parallel'}{'' if move else ', no move'}", graph)
        rows[-1].update(memcpy_nodes=copies.nodes_built, build_s=built_s)
        del graph, copies

    mailbox = torch.zeros(layers, 2 + 2 * MAX_COPIES, dtype=torch.int32).pin_memory()
    mailbox_pointers = [MappedHostPointer(mailbox[layer], torch.int32) for layer in range(layers)]
    counters = torch.zeros(layers, dtype=torch.int32, device="cuda")
    failed = torch.zeros(1, dtype=torch.int32, device="cuda")
    copy_stream = torch.cuda.Stream()
    for wait in ("spin", "wait-value"):
        flags = torch.zeros(layers, dtype=torch.int32, device="cuda")
        service = CopyService(driver, mailbox, routes, flags, copy_stream,
                              (lambda s: s) if wait == "spin" else (lambda s: 1))  # fmt: skip
        service.start()

        def service_step(wait=wait, flags=flags):
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            for layer in range(layers):
                _post_plan[(1,)](plan[layer], mailbox_pointers[layer], counters[layer:], MAX=MAX_COPIES)
                if wait == "spin":
                    _spin_until[(1,)](flags[layer:], counters[layer:], failed, LIMIT=SPIN_LIMIT)
                else:
                    pointer = flags[layer:].data_ptr()
                    assert driver.wait_value(stream, pointer, 1, 1) == 0  # CU_STREAM_WAIT_VALUE_EQ
                    assert driver.write_value(stream, pointer, 0, 0) == 0

        try:
            timed(f"service {wait}", capture(service_step))
            torch.cuda.synchronize()
            rows[-1]["spin_failures"] = int(failed.item())
            rows[-1]["errors"] = len(service.errors)
        except (AssertionError, RuntimeError) as error:
            print(f"service {wait}: {type(error).__name__}: {error}")
        finally:
            service.stop = True
            service.join(timeout=5)
            torch.cuda.synchronize()
    # correctness: the last step's slots equal the store rows of its plan (service wrote them)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--misses", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--huge-pages", action="store_true")
    parser.add_argument("--switch", action="store_true", help="also the conditional SWITCH copies (engine switch)")
    args = parser.parse_args(argv)
    if args.switch and max(args.misses) > _switch_copies.MAX_SWITCHES:
        parser.error(f"--switch takes --misses up to {_switch_copies.MAX_SWITCHES}")
    if args.switch and (why := _switch_copies.unavailable()):
        parser.error(f"--switch cannot run here: {why}")
    if not all(1 <= misses <= SLOTS for misses in args.misses) or args.layers < 1 or args.repeats < 1:
        parser.error(f"--misses must lie in 1..{SLOTS} (distinct slots a layer), --layers and --repeats >= 1")
    sys.setswitchinterval(1e-4)  # the service thread spins: hand the GIL over quickly
    bound = pinned_copy_gbps(256 << 20)
    print(f"copy engine, one 256 MiB pinned copy: {bound:.1f} GB/s")
    rows = []
    for huge in (False, True) if args.huge_pages else (False,):
        store = make_store(huge)
        label = "huge pages" if huge else "pin_memory"
        for misses in args.misses:
            rows += measure(store, args.layers, misses, args.repeats, label, args.switch)
            for row in rows:
                row.setdefault("vs_bound", row["gbps"] / bound)
    print_table(rows, ["store", "misses", "variant", "ms", "gbps", "vs_bound", "equal", "spin_failures", "errors",
                       "memcpy_nodes", "build_s"],
                title=f"{args.layers} layers a step, 9.44 MB experts; bound {bound:.1f} GB/s")  # fmt: skip
    append_csv("bench_copy_service", [{**row, "layers": args.layers, "bound_gbps": bound} for row in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
