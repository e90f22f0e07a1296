"""An FP8 checkpoint's weights against their scales, read from the safetensors headers.

`check_fp8_scales` runs once `expertcache generate` has loaded an FP8 checkpoint: without a
GPU, transformers dequantizes each FP8 weight on the grid of whatever scale lies beside it and
says nothing when that grid is not ``quantization_config.weight_block_size``'s.
"""

from __future__ import annotations

import math
from pathlib import Path

from expertcache.commands.generate_checks import quantization_method, read_model_config

#: safetensors' names of the FP8 value dtypes, and of the float dtypes no FP8 scale belongs beside
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
#: what an FP8 weight ``X.weight``'s scale is named: ``X.<suffix>`` (transformers renames the others to the first)
_FP8_SCALE_SUFFIXES = ("weight_scale_inv", "scale", "qscale_weight")


def check_fp8_scales(path: Path) -> None:
    """Refuse an FP8 checkpoint whose weights and scales do not pair up as config.json's
    ``weight_block_size`` says (read from the safetensors headers). Without a GPU transformers
    dequantizes each weight on the grid of whatever scale lies beside it and says nothing when
    that grid is not the config's (scales transposed or too few), when a weight has no scale (a
    dense one loads its e4m3 values unscaled; an expert projection stays float8, which no experts
    function multiplies: a traceback mid-generation), or when the weight beside a scale is float
    already (multiplied by it again). Run after the load, whose own refusals come first.

    Raises:
        ValueError: the first such tensors, in one line.
    """
    from transformers import AutoConfig
    from transformers.quantizers.auto import AutoQuantizationConfig

    model_config = read_model_config(AutoConfig, path)
    if quantization_method(model_config) != "fp8":
        return
    quantization = model_config.quantization_config
    fields = dict(quantization) if isinstance(quantization, dict) else quantization.to_dict()
    block = AutoQuantizationConfig.from_dict(fields).weight_block_size  # transformers' default when absent
    headers = _safetensors_headers(path)
    problems = [problem for name in headers if (problem := _fp8_problem(name, headers, block))]
    if problems:
        shown = "; ".join(problems[:2]) + (f"; and {len(problems) - 2} more" if len(problems) > 2 else "")
        raise ValueError(
            f"--model {path}: the FP8 weights and scales do not pair up as quantization_config.weight_block_size "
            f"{None if block is None else list(block)} says ({shown}); transformers would load them mis-scaled"
        )


def _safetensors_headers(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (safetensors dtype name, shape) from the headers; empty for a checkpoint
    of ``pytorch_model*.bin`` files, which have no headers to read."""
    from safetensors import safe_open

    from expertcache.integrations.transformers.packed_models import safetensors_files

    try:
        files = safetensors_files(path)
    except ValueError:  # no safetensors: transformers loaded the .bin files
        return {}
    headers = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                part = handle.get_slice(name)
                headers[name] = (part.get_dtype(), list(part.get_shape()))
    return headers


def _fp8_problem(name: str, headers, block) -> str:
    """What is wrong with tensor ``name`` of an FP8 checkpoint (``""``: nothing): an FP8 weight
    without a scale or with one off its grid of ``block``, or a scale beside a float weight."""
    dtype, shape = headers[name]
    if name.endswith(".weight") and dtype in _FP8_DTYPES and len(shape) >= 2:
        stem = name.removesuffix("weight")
        scale = next((stem + suffix for suffix in _FP8_SCALE_SUFFIXES if stem + suffix in headers), None)
        if scale is None:
            return f"{name} {dtype} has no weight_scale_inv"
        grid = [1, 1] if block is None else [-(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
        scale_shape = headers[scale][1]
        per_tensor = grid == [1, 1] and math.prod(scale_shape) == math.prod(shape[:-2])  # [], [1], [E]
        if scale_shape != shape[:-2] + grid and not per_tensor:
            return f"{scale} is {scale_shape}, not {shape[:-2] + grid} for {name} {shape}"
    if name.endswith(".weight_scale_inv"):
        weight = headers.get(name.removesuffix("_scale_inv"))
        if weight is not None and weight[0] in _FLOAT_DTYPES:
            return f"{name} is beside a {weight[0]} weight, not an FP8 one"
    return ""
