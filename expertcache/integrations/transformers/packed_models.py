"""Packed experts in a transformers model: load GPT-OSS's MXFP4 checkpoint tensors as they
are, or quantize float experts to FP8 or MXFP4.

`load_mxfp4_experts` replaces each GPT-OSS experts module by an `Mxfp4Experts` holding the
checkpoint's blocks and scales (transformers itself runs MXFP4 only through the hub's
swizzled triton kernels, or dequantizes to bf16); `quantize_experts` turns a random or float
model's experts into transformers' `FP8Experts` or `Mxfp4Experts` (for benchmarks and tests
at real shapes without a checkpoint). Both dispatch through the experts registries that
`quantized` fills: ``"expertcache_quant"`` runs the project's kernels on the packed bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation

from expertcache.integrations.transformers.quantized import (
    MXFP4_EXPERTS_FUNCTIONS,
    dequant_experts_forward,
    is_quantized,
)
from expertcache.quant_fp8 import quantize_fp8_blocks
from expertcache.quant_mxfp4 import GROUP, mxfp4_groups, quantize_mxfp4


@use_experts_implementation(experts_interface=MXFP4_EXPERTS_FUNCTIONS, has_bias=True)
class Mxfp4Experts(nn.Module):
    """GPT-OSS experts holding their MXFP4 checkpoint tensors (shapes in the module docstring).

    Computes GPT-OSS's clamped SwiGLU on interleaved gate/up rows; ``forward`` (``eager``)
    dequantizes in torch, the other registered names run the Triton kernels.
    """

    def __init__(self, config, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for name in MXFP4_TENSORS:
            tensor = tensors[name]
            if name.endswith("_blocks"):
                tensor = tensor.reshape(*tensor.shape[:2], -1)  # 3-D, as transformers declares them
            self.register_parameter(name.removesuffix("_blocks"), nn.Parameter(tensor, requires_grad=False))
        shape = tensors["gate_up_proj_scales"].shape  # [E, 2I, G(H)]
        self.num_experts = int(shape[0])
        self.hidden_size = int(config.hidden_size)
        # the config's, where it has one: a tensor of the wrong shape is then the one named
        self.intermediate_size = int(getattr(config, "intermediate_size", None) or int(shape[1]) // 2)
        self.alpha = 1.702
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        _check_mxfp4_shapes(self)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return dequant_experts_forward(self, hidden_states, top_k_index, top_k_weights)


#: The tensors of one GPT-OSS MXFP4 experts module in a checkpoint (under ``<module>.``).
MXFP4_TENSORS = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "gate_up_proj_bias",
    "down_proj_blocks",
    "down_proj_scales",
    "down_proj_bias",
)


def _check_mxfp4_shapes(module: Mxfp4Experts) -> None:
    experts, inter, hidden = module.num_experts, module.intermediate_size, module.hidden_size
    expected = {
        "gate_up_proj": (experts, 2 * inter, mxfp4_groups(hidden) * GROUP // 2),
        "gate_up_proj_scales": (experts, 2 * inter, mxfp4_groups(hidden)),
        "gate_up_proj_bias": (experts, 2 * inter),
        "down_proj": (experts, hidden, mxfp4_groups(inter) * GROUP // 2),
        "down_proj_scales": (experts, hidden, mxfp4_groups(inter)),
        "down_proj_bias": (experts, hidden),
    }
    for name, shape in expected.items():
        tensor = getattr(module, name)
        if tuple(tensor.shape) != shape or (not name.endswith("bias") and tensor.dtype != torch.uint8):
            raise ValueError(f"MXFP4 {name} must be {'' if name.endswith('bias') else 'uint8 '}{list(shape)}, "
                             f"got {tensor.dtype} {list(tensor.shape)}")  # fmt: skip


def load_mxfp4_experts(model: nn.Module, checkpoint: str | os.PathLike | Mapping[str, torch.Tensor]) -> list[str]:
    """Replace every experts module whose MXFP4 tensors the checkpoint holds by an
    `Mxfp4Experts` holding them packed (the module's dequantized weights are dropped).

    For a GPT-OSS checkpoint loaded where transformers dequantizes it (no hub kernels:
    ``from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True))``); then
    `enable_expert_cache` serves the packed bytes.

    Args:
        model: the loaded model.
        checkpoint: its directory (``*.safetensors``; only the expert tensors are read), or
            a mapping of the checkpoint's names to tensors.

    Returns:
        The names of the replaced modules, in model order.

    Raises:
        TypeError: ``model`` is not a module; ``checkpoint`` neither a path nor a mapping, or
            one of its entries not a tensor.
        ValueError: the checkpoint holds MXFP4 tensors for no module of ``model``, misses one
            of a module's tensors, or holds them for a module that is not GPT-OSS experts of
            the same number or that an expert cache serves (nothing is replaced then).
    """
    _check_model(model)
    _check_not_served(model, [name for name, _ in model.named_modules()], "loading MXFP4 experts")  # before reading
    tensors = _mxfp4_tensors(model, checkpoint)
    if not tensors:
        raise ValueError("the checkpoint holds no '<experts>.gate_up_proj_blocks' for any module of this model")
    replacements = {name: _mxfp4_module(name, model.get_submodule(name), parts) for name, parts in tensors.items()}
    for name, module in replacements.items():  # all built: nothing can fail from here
        model.set_submodule(name, module)
    return list(tensors)


#: The fewest dimensions each MXFP4 tensor has (blocks: ``[E, rows, G, 16]`` as checkpoints
#: hold them, or ``[E, rows, G * 16]``).
_MXFP4_MIN_DIMS = {"blocks": 3, "scales": 3, "bias": 2}


def _mxfp4_module(name: str, old: nn.Module, parts: dict[str, torch.Tensor]) -> Mxfp4Experts:
    for part, tensor in parts.items():  # before any shape is read: a 0-dim or empty one is named
        if tensor.dim() < _MXFP4_MIN_DIMS[part.rsplit("_", 1)[1]] or tensor.numel() == 0:
            raise ValueError(f"{name}.{part} has shape {list(tensor.shape)}: not an MXFP4 checkpoint tensor "
                             f"(nothing was replaced)")  # fmt: skip
    experts = parts["gate_up_proj_blocks"].shape[0]
    if not getattr(old, "has_bias", False) or getattr(old, "num_experts", None) != experts:
        raise ValueError(f"{name} ({type(old).__name__}) is not a GPT-OSS experts module with the checkpoint's "
                         f"{experts} experts and biases: nothing was replaced")  # fmt: skip
    weight = old.get_parameter("gate_up_proj")
    device = parts["gate_up_proj_blocks"].device if weight.is_meta else weight.device
    return Mxfp4Experts(old.config, {key: value.to(device) for key, value in parts.items()})


def _mxfp4_tensors(model: nn.Module, checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    if not isinstance(checkpoint, (Mapping, str, os.PathLike)):
        raise TypeError(f"checkpoint must be a directory (str or PathLike) or a mapping of names to tensors, "
                        f"got {type(checkpoint).__name__}")  # fmt: skip
    names = [name for name, _ in model.named_modules()]
    if isinstance(checkpoint, Mapping):
        read = checkpoint.__getitem__
        keys = set(checkpoint)
    else:
        read, keys = _safetensors_reader(checkpoint)
    found = {}
    for name in names:
        if f"{name}.gate_up_proj_blocks" not in keys:
            continue
        dense = [f"{name}.{part}" for part in ("gate_up_proj", "down_proj") if f"{name}.{part}" in keys]
        if dense:  # transformers computes with those: serving the blocks would compute something else
            raise ValueError(f"the checkpoint holds {dense[0]} beside the MXFP4 blocks of {name}: two weights for "
                             f"the same experts; keep one of them (nothing was replaced)")  # fmt: skip
        missing = [f"{name}.{part}" for part in MXFP4_TENSORS if f"{name}.{part}" not in keys]
        if missing:
            raise ValueError(f"the checkpoint holds {name}.gate_up_proj_blocks but not {', '.join(missing)}: "
                             f"nothing was replaced")  # fmt: skip
        found[name] = {part: read(f"{name}.{part}") for part in MXFP4_TENSORS}
        for part, tensor in found[name].items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"checkpoint[{f'{name}.{part}'!r}] must be a torch.Tensor, got "
                                f"{type(tensor).__name__}: nothing was replaced")  # fmt: skip
    return found


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")


def _check_not_served(model: nn.Module, names, what: str) -> None:
    """Refuse to replace experts an expert cache serves (the cache would keep the old modules)."""
    from expertcache.integrations.transformers.dispatch import is_bound

    served = [name for name in names if is_bound(model.get_submodule(name))]
    if served:
        raise ValueError(f"{served[0]} is served by an expert cache: disable() it before {what} "
                         f"(nothing was replaced)")  # fmt: skip


def safetensors_files(directory: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it: ``model.safetensors``, else the shards
    ``model.safetensors.index.json`` names (the order transformers loads them in).

    Raises:
        ValueError: neither file is there, or the index is not JSON with a ``weight_map`` of
            names to file names. OSError / safetensors' error: ``model.safetensors`` unreadable.
    """
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):  # transformers' order: the single file first, then the index
        with safe_open(single, framework="pt") as handle:
            return {key: single for key in handle.keys()}  # noqa: SIM118 - safe_open has no __iter__
    if os.path.isfile(index):
        try:
            with open(index, "rb") as file:
                weight_map = json.loads(file.read().decode("utf-8")).get("weight_map")
        except (ValueError, RecursionError, AttributeError) as error:  # not UTF-8, not JSON, not an object
            raise ValueError(f"model.safetensors.index.json is not a JSON object ({error})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError("model.safetensors.index.json has no weight_map of tensor names to file names")
        return {key: os.path.join(directory, name) for key, name in weight_map.items()}
    raise ValueError("the directory has neither model.safetensors nor model.safetensors.index.json")


def mxfp4_headers(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], set[str]]:
    """What `load_mxfp4_experts` would read from ``directory``, without reading it: a
    meta-device tensor of each MXFP4 expert tensor's (and dense expert weight's) shape and dtype (from the safetensors
    headers), and every name the checkpoint holds. ``load_mxfp4_experts(meta_model, headers)``
    then checks a checkpoint before anything loads.

    Raises:
        As `safetensors_files`; OSError / safetensors' error: a shard missing or unreadable.
    """
    from safetensors import safe_open

    files = safetensors_files(directory)
    wanted: dict[str, list[str]] = {}
    for key, file in files.items():  # the dense weights too: `load_mxfp4_experts` refuses them beside blocks
        if key.rsplit(".", 1)[-1] in (*MXFP4_TENSORS, "gate_up_proj", "down_proj"):
            wanted.setdefault(file, []).append(key)
    headers = {}
    for file, names in wanted.items():
        with safe_open(file, framework="pt") as handle:
            for key in names:
                part = handle.get_slice(key)  # the header; [:0] reads no data and has the dtype
                dtype = part[:0].dtype if part.get_shape() else handle.get_tensor(key).dtype
                headers[key] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    return headers, set(files)


def _safetensors_reader(directory: str | os.PathLike):
    from safetensors import safe_open

    file_of = safetensors_files(directory)

    def read(key: str) -> torch.Tensor:
        with safe_open(file_of[key], framework="pt") as handle:
            return handle.get_tensor(key)

    return read, set(file_of)


#: `quantize_experts`' FP8 scale block: DeepSeek-V3's and Qwen3-FP8's.
FP8_BLOCK = (128, 128)


def quantize_experts(model: nn.Module, fmt: str, *, block: tuple[int, int] | None = FP8_BLOCK) -> list[str]:
    """Quantize a float model's routed experts in place into a checkpoint's packed format.

    For tests and benchmarks over random weights (a real checkpoint arrives packed). Every
    module is quantized (a few experts at a time) before the model changes, so an error
    leaves it as it was; the peak memory is the float model's plus the packed experts'.

    Args:
        model: a transformers model with float experts (``mlp.experts`` modules).
        fmt: ``"fp8"``: transformers' ``FP8Experts`` (e4m3 values, fp32 ``*_scale_inv``), for
            gated experts without biases (Qwen3-MoE, DeepSeek-V3, ...); ``"mxfp4"``: an
            `Mxfp4Experts` (e2m1 blocks, e8m0 scales per 32 values, biases kept), for GPT-OSS.
        block: FP8 scale block (rows, columns); None: per tensor (gate and up apart, as
            transformers keeps them). MXFP4's groups are fixed (32 values): any other block
            than the default is refused there.

    Returns:
        The names of the replaced modules, in model order.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: an unknown format, a bad block, experts the format does not apply to,
            or experts an expert cache serves (nothing is replaced then).
    """
    _check_model(model)
    experts = {name: module for name, module in model.named_modules() if name.endswith("mlp.experts")}
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"unknown expert format {fmt!r}: expected 'fp8' or 'mxfp4'")
    if fmt == "mxfp4" and block != FP8_BLOCK:
        raise ValueError(f"block applies to fp8 only (MXFP4 scales groups of 32 values), got block={block!r}")
    if block is not None and not (
        isinstance(block, tuple) and len(block) == 2 and all(type(size) is int and size >= 1 for size in block)
    ):
        raise ValueError(f"block must be None (per tensor) or two positive ints (rows, columns), got {block!r}")
    _check_not_served(model, experts, "quantizing")
    if not experts or not all(_quantizable(module, fmt) for module in experts.values()):
        wanted = "GPT-OSS experts (with biases)" if fmt == "mxfp4" else "gated experts without biases"
        raise ValueError(f"{fmt} quantization needs float {wanted}; this model's are not: nothing was replaced")
    if fmt == "mxfp4":
        checkpoint = {}
        for name, module in experts.items():  # GPT-OSS keeps x @ W: [E, H, 2I], [E, I, H]
            for proj in ("gate_up_proj", "down_proj"):
                blocks, scales = _chunked(quantize_mxfp4, module.get_parameter(proj).detach().transpose(1, 2))
                checkpoint[f"{name}.{proj}_blocks"], checkpoint[f"{name}.{proj}_scales"] = blocks, scales
                checkpoint[f"{name}.{proj}_bias"] = module.get_parameter(f"{proj}_bias").detach()
        return load_mxfp4_experts(model, checkpoint)
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    packed = {}  # every module quantized before the model changes: an error leaves it as it was
    for name, module in experts.items():
        for proj in ("gate_up_proj", "down_proj"):
            weight = module.get_parameter(proj).detach()
            rows, cols = weight.shape[-2:]
            tile = block or ((rows // 2, cols) if proj == "gate_up_proj" else (rows, cols))
            packed[name, proj] = _chunked(lambda w, tile=tile: quantize_fp8_blocks(w, tile), weight)
    experts.clear()
    config = FineGrainedFP8Config(weight_block_size=block)  # type: ignore[arg-type]  # None: per-tensor scales
    replace_with_fp8_linear(model, modules_to_not_convert=[r"(?!.*\.experts$).*"], quantization_config=config,
                            pre_quantized=True)  # meta modules: only the experts become FP8  # fmt: skip
    for (name, proj), (values, scales) in packed.items():
        module = model.get_submodule(name)
        setattr(module, proj, nn.Parameter(values, requires_grad=False))
        setattr(module, f"{proj}_scale_inv", nn.Parameter(scales, requires_grad=False))
    return [name for name, _ in model.named_modules() if name.endswith("mlp.experts")]


def _chunked(quantize, weight: torch.Tensor, experts_at_once: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [quantize(weight[start : start + experts_at_once]) for start in range(0, weight.shape[0], experts_at_once)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _quantizable(module: nn.Module, fmt: str) -> bool:
    if not isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) or is_quantized(module):
        return False
    return bool(getattr(module, "has_bias", False)) == (fmt == "mxfp4")
