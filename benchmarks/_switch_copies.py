"""Copy-engine copies chosen on the GPU inside a CUDA graph: conditional SWITCH nodes.

A memcpy node's addresses are fixed when the graph is built, and device mode's plan (which
expert goes where) exists only on the GPU. A SWITCH node (CUDA 12.8+) picks one of its body
graphs from a value a kernel sets on the GPU, so a graph can hold, for each miss ``k`` of a
layer, one SWITCH over the experts whose body ``e`` copies expert ``e`` into a fixed staging
buffer ``k`` with the copy engine; a kernel then moves staging ``k`` into the miss's slot over
HBM (about 5 us for 9.44 MB, against ~170 us over PCIe):

    set_switches  (1 program)   handle[k] <- plan's expert k, or "none" past the plan's count
    SWITCH k      body e        memcpy store[e] -> staging[k]   (per tensor, the copy engine)
    staging_to_slots            staging[k] -> slots[plan's slot k]

Nodes a layer: ``misses x experts x tensors`` memcpy nodes, of which a step runs only the
chosen bodies. This module builds those nodes into a graph that torch is capturing (through
``cuda.bindings`` and a setter kernel that ``nvcc`` builds at first use); it is an
experiment of `bench_copy_service.py`, not part of the library.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

MAX_SWITCHES = 16  # switches a setter launch serves (its handles travel by value)

_SETTER_SOURCE = r"""
struct Handles { unsigned long long value[MAX_SWITCHES]; };
extern "C" __global__ void set_switches(const int* plan, Handles handles, int switches, unsigned int none) {
    int k = threadIdx.x;
    if (k < switches) {
        unsigned int value = k < plan[0] ? (unsigned int)plan[1 + 2 * k] : none;
        cudaGraphSetConditional(handles.value[k], value);
    }
}
""".replace("MAX_SWITCHES", str(MAX_SWITCHES))


def unavailable() -> str | None:
    """Why the switch copies cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no GPU"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda.bindings (cuda-python) is not installed"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH (it builds the setter kernel)"
    return None


@triton.jit
def _staging_to_slots(plan_ptr, staging_ptr, slots_ptr, words, WORDS_A_PROGRAM: tl.constexpr):
    """``slots[plan slot k] <- staging[k]`` for each planned miss ``k`` (int64 words)."""
    k = tl.program_id(0)
    if k < tl.load(plan_ptr):
        slot = tl.load(plan_ptr + 2 + 2 * k).to(tl.int64)
        lanes = tl.program_id(1) * WORDS_A_PROGRAM + tl.arange(0, WORDS_A_PROGRAM)
        inside = lanes < words
        data = tl.load(staging_ptr + k * words + lanes, mask=inside)
        tl.store(slots_ptr + slot * words + lanes, data, mask=inside)


class SwitchCopies:
    """Builds, inside a torch capture, a layer's copies as SWITCH nodes over the experts.

    ``store``: pinned ``uint8`` store; ``offsets[j]``, ``nbytes[j]``: where tensor ``j`` of
    expert ``e`` lies (``offsets[j] + e * nbytes[j]``); ``slots[j]``: ``[S, ...]`` GPU slot
    tensors; ``misses``: switches a layer (staging buffers); ``chained``: the switches one
    after another (else side by side, each free to take its own copy queue); ``move``: False
    leaves the copies in staging (an ablation: what the staging-to-slot kernel costs).
    """

    def __init__(self, store: torch.Tensor, offsets, nbytes, slots, experts: int, misses: int, chained: bool,
                 move: bool = True):  # fmt: skip
        if not 1 <= misses <= MAX_SWITCHES:
            raise ValueError(f"misses must lie in 1..{MAX_SWITCHES}, got {misses}")
        from cuda.bindings import driver

        self.cu, self.store, self.offsets, self.nbytes = driver, store, offsets, nbytes
        self.slots, self.experts, self.misses, self.chained = slots, experts, misses, chained
        self.move = move
        self.staging = [torch.empty(misses, n // 8, dtype=torch.int64, device="cuda") for n in nbytes]
        self.major = int(__import__("cuda.bindings").bindings.__version__.split(".")[0])
        self._check(driver.cuInit(0))
        self.ctx = self._check(driver.cuCtxGetCurrent())
        self.setter = self._build_setter()
        self.nodes_built = 0
        for staging, slot in zip(self.staging, self.slots, strict=True):  # compile outside any capture
            self._move(torch.zeros(1, dtype=torch.int32, device="cuda"), staging, slot)

    def _check(self, result):
        error, *values = result if isinstance(result, tuple) else (result,)
        if error != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {error}")
        return values[0] if len(values) == 1 else values

    def _build_setter(self):
        major, minor = torch.cuda.get_device_capability()
        with tempfile.TemporaryDirectory() as folder:
            source, cubin = Path(folder) / "set_switches.cu", Path(folder) / "set_switches.cubin"
            source.write_text(_SETTER_SOURCE)
            subprocess.run(["nvcc", "-cubin", f"-arch=sm_{major}{minor}", "-o", str(cubin), str(source)],
                           check=True, capture_output=True)  # fmt: skip
            module = self._check(self.cu.cuModuleLoad(str(cubin).encode()))
        return self._check(self.cu.cuModuleGetFunction(module, b"set_switches"))

    def _capture_state(self, stream):
        info = self._check(self.cu.cuStreamGetCaptureInfo(stream))
        return info[2], list(info[3] or [])  # graph, the next node's dependencies

    def _add_node(self, graph, dependencies, params):
        if self.major >= 13:
            return self._check(self.cu.cuGraphAddNode(graph, dependencies, None, len(dependencies), params))
        return self._check(self.cu.cuGraphAddNode(graph, dependencies, len(dependencies), params))

    def _set_dependencies(self, stream, nodes):
        set_flag = self.cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        if self.major >= 13:
            self._check(self.cu.cuStreamUpdateCaptureDependencies(stream, nodes, None, len(nodes), set_flag))
        else:
            self._check(self.cu.cuStreamUpdateCaptureDependencies(stream, nodes, len(nodes), set_flag))

    def _memcpy(self, body, source: int, target: int, nbytes: int) -> None:
        cu = self.cu
        copy = cu.CUDA_MEMCPY3D()
        copy.srcMemoryType, copy.srcHost = cu.CUmemorytype.CU_MEMORYTYPE_HOST, source
        copy.dstMemoryType, copy.dstDevice = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE, target
        copy.WidthInBytes, copy.Height, copy.Depth = nbytes, 1, 1
        copy.srcPitch = copy.dstPitch = nbytes
        self._check(cu.cuGraphAddMemcpyNode(body, None, 0, copy, self.ctx))
        self.nodes_built += 1

    def _move(self, plan_row: torch.Tensor, staging: torch.Tensor, slot: torch.Tensor) -> None:
        words = staging.shape[1]
        grid = (self.misses, triton.cdiv(words, 8192))
        _staging_to_slots[grid](plan_row, staging, slot.view(torch.int64), words, WORDS_A_PROGRAM=8192)

    def enqueue(self, plan_row: torch.Tensor) -> None:
        """Capture one layer's copies for ``plan_row`` (``[count, e0, s0, e1, s1, ...]`` int32)."""
        cu = self.cu
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        graph, _ = self._capture_state(stream)
        assign_default = cu.CU_GRAPH_COND_ASSIGN_DEFAULT
        handles = [self._check(cu.cuGraphConditionalHandleCreate(graph, self.ctx, self.experts, assign_default))
                   for _ in range(self.misses)]  # fmt: skip
        values = (ctypes.c_uint64 * MAX_SWITCHES)(*[int(handle) for handle in handles])
        args = [ctypes.c_uint64(plan_row.data_ptr()), values, ctypes.c_int(self.misses), ctypes.c_uint(self.experts)]
        pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(arg) for arg in args])
        self._check(cu.cuLaunchKernel(self.setter, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(pointers), 0))
        graph, after = self._capture_state(stream)
        ends: list = []
        for k, handle in enumerate(handles):
            params = cu.CUgraphNodeParams()
            params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
            params.conditional.handle = handle
            params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH
            params.conditional.size = self.experts
            params.conditional.ctx = self.ctx
            dependencies = [ends[-1]] if self.chained and ends else after
            ends.append(self._add_node(graph, dependencies, params))
            for expert, body in enumerate(params.conditional.phGraph_out):
                for j, staging in enumerate(self.staging):
                    source = self.store.data_ptr() + self.offsets[j] + expert * self.nbytes[j]
                    self._memcpy(body, source, staging[k].data_ptr(), self.nbytes[j])
        self._set_dependencies(stream, ends[-1:] if self.chained else ends)
        for staging, slot in zip(self.staging, self.slots, strict=True) if self.move else ():
            self._move(plan_row, staging, slot)
