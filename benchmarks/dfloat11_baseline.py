"""DFloat11 (prior art: Huffman-coded bf16 exponents, arXiv 2504.11651) as a baseline, guarded.

Used through its own published functions, never copied: its encoder
(``dfloat11_utils.get_codec / get_32bit_codec / get_luts / encode_weights``) for ratios, and
its CUDA ``decode`` kernel (cupy) for GPU decode throughput, launched with the arguments its
own correctness check uses. ``import dfloat11`` pulls in cupy, accelerate and
``pkg_resources``; when that fails the encoder module is loaded from the installed file
alone (it needs only dahuffman, numpy, tqdm) and the kernel from the wheel's ``decode.ptx``.
Every entry point returns "unavailable: <reason>" instead of raising.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

#: DFloat11 0.5.0's launch constants (``dfloat11.dfloat11``), used when the package cannot be imported.
THREADS_PER_BLOCK, BYTES_PER_THREAD = 512, 8

_state: dict[str, object] = {}


def _package_dir() -> Path:
    spec = importlib.util.find_spec("dfloat11")  # finds without executing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'dfloat11'")
    return Path(next(iter(spec.submodule_search_locations)))


def _load() -> None:
    """Import DFloat11 once: the whole package, else its encoder module from its file."""
    if _state:
        return
    try:
        package = importlib.import_module("dfloat11.dfloat11")
        _state.update(utils=importlib.import_module("dfloat11.dfloat11_utils"), package=package)
        _state["status"] = "dfloat11 package (encoder and cupy kernel)"
        return
    except Exception as error:  # noqa: BLE001 - any failure is reported, not raised
        _state["package_error"] = f"{type(error).__name__}: {error}"
    try:
        spec = importlib.util.spec_from_file_location("dfloat11_utils_file", _package_dir() / "dfloat11_utils.py")
        utils = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(utils)  # type: ignore[union-attr]
        _state.update(utils=utils, status=f"encoder from its file (import dfloat11: {_state['package_error']})")
    except Exception as error:  # noqa: BLE001
        _state["status"] = f"unavailable: {type(error).__name__}: {error}"


def status() -> str:
    _load()
    return str(_state["status"])


def _quiet(function: Callable, *args):
    """Call ``function`` with its prints and tqdm bars swallowed."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return function(*args)


def encode(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """DFloat11's encoding of one bf16 tensor (CPU tensors: luts, encoded, sign_mantissa,
    output_positions, gaps). Raises when DFloat11 is unavailable."""
    _load()
    utils: ModuleType | None = _state.get("utils")  # type: ignore[assignment]
    if utils is None:
        raise RuntimeError(str(_state["status"]))
    flat = tensor.detach().reshape(-1).cpu()
    _, counter = _quiet(utils.get_codec, flat)
    codec, _, table = _quiet(utils.get_32bit_codec, counter)
    luts = _quiet(utils.get_luts, table)
    encoded, sign_mantissa, positions, gaps, _ = _quiet(
        utils.encode_weights, [flat], codec, BYTES_PER_THREAD, THREADS_PER_BLOCK
    )
    return {"luts": luts, "encoded": encoded, "sign_mantissa": sign_mantissa, "output_positions": positions,
            "gaps": gaps}  # fmt: skip


def coded_bytes(parts: dict[str, torch.Tensor]) -> int:
    """Every byte DFloat11 stores for the tensor (its lookup tables included)."""
    return sum(part.numel() * part.element_size() for part in parts.values())


def ratio(tensor: torch.Tensor) -> float | str:
    """DFloat11's stored / raw bytes of a bf16 ``tensor``, or "unavailable: <reason>"."""
    if tensor.dtype != torch.bfloat16:
        return "unavailable: DFloat11 codes bfloat16 only"
    if status().startswith("unavailable"):
        return "unavailable"  # the reason: status(), printed once
    try:
        return coded_bytes(encode(tensor)) / tensor.nbytes
    except Exception as error:  # noqa: BLE001
        return f"unavailable: {type(error).__name__}: {error}"


def _bytes_alike(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32) if tensor.dtype == torch.uint32 else tensor


def _kernel():
    """(cupy, DFloat11's decode function, threads per block, bytes per thread)."""
    import cupy

    package = _state.get("package")
    if package is not None:
        return cupy, package._decode, package.threads_per_block[0], package.bytes_per_thread
    module = cupy.RawModule(path=str(_package_dir() / "decode.ptx"))
    return cupy, module.get_function("decode"), THREADS_PER_BLOCK, BYTES_PER_THREAD


def decode_rows(tensor: torch.Tensor, device: torch.device, time_ms: Callable[[Callable], float]) -> list[dict]:
    """DFloat11's GPU decode of ``tensor``: input already on the GPU, and copied from pinned
    memory first (its offload path). One row each, or one "unavailable" row."""
    name = "DFloat11 decode"
    if device.type != "cuda":
        return [{"decoder": name, "note": "unavailable: needs a GPU"}]
    try:
        _load()
        cupy, decode, threads, per_thread = _kernel()
        parts = encode(tensor)
        # uint32 positions travel as int32 (the same bytes; torch copies few uint32 ops to CUDA)
        on_gpu = {key: _bytes_alike(part).to(device) for key, part in parts.items()}
        pinned = {key: parts[key].pin_memory() for key in ("encoded", "sign_mantissa")}
        out = torch.empty(tensor.numel(), dtype=torch.bfloat16, device=device)
        positions = parts["output_positions"].numpy().astype("int64")
        shared = threads * 4 + 4 + int((positions[1:] - positions[:-1]).max()) * 2
        n_bytes, n_elements = parts["encoded"].numel(), parts["sign_mantissa"].numel()
        grid = (math.ceil(n_bytes / (threads * per_thread)),)
        args = [on_gpu[key].data_ptr() for key in ("luts", "encoded", "sign_mantissa", "output_positions", "gaps")]
        args += [out.data_ptr(), parts["luts"].shape[0], n_bytes, n_elements]

        def launch() -> None:
            with cupy.cuda.Device(device.index or 0):
                decode(grid=grid, block=(threads,), shared_mem=shared, args=args)

        def copy_then_launch() -> None:
            for key, host in pinned.items():
                on_gpu[key].copy_(host, non_blocking=True)
            launch()

        ratio_value = coded_bytes(parts) / tensor.nbytes
        rows = []
        for label, run in ((f"{name} (input on the GPU)", launch), (f"{name} after a pinned copy", copy_then_launch)):
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            exact = torch.equal(out.view(torch.int16), tensor.reshape(-1).view(torch.int16))
            ms = time_ms(run)
            rows.append({"decoder": label, "ratio": ratio_value, "ms": ms, "raw_gbps": tensor.nbytes / ms / 1e6,
                         "exact": exact, "note": status()})  # fmt: skip
        return rows
    except Exception as error:  # noqa: BLE001
        return [{"decoder": name, "note": f"unavailable: {type(error).__name__}: {error}"}]


if __name__ == "__main__":
    print(status())
    sample = (torch.randn(4096, 512) * 0.02).to(torch.bfloat16)
    print("ratio", ratio(sample))
    sys.exit(0)
