"""An FP8 checkpoint's weights against their scales, read from the safetensors headers.

`check_fp8_scales` runs before `expertcache generate` loads an FP8 checkpoint: without a GPU,
transformers dequantizes each FP8 weight on the grid of whatever scale lies beside it and says
nothing when that grid is not ``quantization_config.weight_block_size``'s. Only the headers are
read, so a bad checkpoint is refused before its weights are.
"""

from __future__ import annotations

import math
from pathlib import Path

from expertcache.commands.generate_checks import quantization_method, refused_load

#: safetensors' names of the FP8 value dtypes, and of the float dtypes no FP8 scale belongs beside
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
#: what an FP8 weight ``X.weight``'s scale is named: ``X.<suffix>`` (transformers renames the others to the first)
_FP8_SCALE_SUFFIXES = ("weight_scale_inv", "scale", "qscale_weight")


def check_fp8_scales(path: Path, model_config) -> None:
    """Refuse an FP8 checkpoint whose weights and scales do not pair up as config.json's
    ``weight_block_size`` says (read from the safetensors headers). Without a GPU transformers
    dequantizes each weight on the grid of whatever scale lies beside it and says nothing when
    that grid is not the config's (scales transposed or too few), when a weight has no scale (a
    dense one loads its e4m3 values unscaled; an expert projection stays float8, which no experts
    function multiplies: a traceback mid-generation), or when the weight beside a scale is float
    already (multiplied by it again).

    Args:
        path: the checkpoint directory.
        model_config: its transformers config (`read_model_config`); nothing is checked unless
            its ``quantization_config`` is FP8.

    Raises:
        ValueError: the first such tensors, in one line; or, as a refused load (``--model DIR:
            cannot load the weights (...)``), headers that cannot be read (the index not JSON,
            a shard missing or not safetensors).
    """
    from transformers.quantizers.auto import AutoQuantizationConfig

    if quantization_method(model_config) != "fp8":
        return
    quantization = model_config.quantization_config
    fields = dict(quantization) if isinstance(quantization, dict) else quantization.to_dict()
    block = AutoQuantizationConfig.from_dict(fields).weight_block_size  # transformers' default when absent
    headers = _safetensors_headers(path)
    problems = [problem for name in headers if (problem := _fp8_problem(name, headers, block))]
    if problems:
        shown = _first(problems, "; ")
        paired = {_scale_of(name, headers) for name in headers}
        unpaired = [name for name in headers if _is_weight_scale(name) and name not in paired]
        if unpaired:  # scales under names no weight reads: what the user should look at
            shown += f"; scales beside no FP8 weight: {_first(unpaired, ', ')}"
        raise ValueError(
            f"--model {path}: the FP8 weights and scales do not pair up as quantization_config.weight_block_size "
            f"{None if block is None else list(block)} says ({shown}); transformers would load them mis-scaled"
        )


def _safetensors_headers(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (safetensors dtype name, shape) from the headers; empty for a checkpoint
    of ``pytorch_model*.bin`` files, which have no headers to read.

    Raises:
        ValueError: ``--model DIR: cannot load the weights (...)``: the index is not JSON with a
            weight map, or a file it names is missing or not safetensors.
    """
    from safetensors import SafetensorError, safe_open

    from expertcache.integrations.transformers.packed_models import safetensors_files

    has_safetensors = any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))
    if not has_safetensors:  # transformers loads the .bin files
        return {}
    headers = {}
    try:
        for file in sorted(set(safetensors_files(path).values())):
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    part = handle.get_slice(name)
                    headers[name] = (part.get_dtype(), list(part.get_shape()))
    except (OSError, ValueError, SafetensorError) as error:
        raise refused_load(path, error) from None
    return headers


def _first(items: list[str], separator: str) -> str:
    """The first two of ``items`` and how many more."""
    return separator.join(items[:2]) + (f"{separator}and {len(items) - 2} more" if len(items) > 2 else "")


def _is_weight_scale(name: str) -> bool:
    """Whether ``name`` looks like a weight's scale (not an activation's ``input_scale``)."""
    last = name.rsplit(".", 1)[-1]
    return last.endswith("scale_inv") or "weight_scale" in last or last in _FP8_SCALE_SUFFIXES


def _scale_of(name: str, headers) -> str | None:
    """The scale transformers reads for weight ``name`` (``X.weight``): ``X.<suffix>``, else None."""
    if not name.endswith(".weight"):
        return None
    stem = name.removesuffix("weight")
    return next((stem + suffix for suffix in _FP8_SCALE_SUFFIXES if stem + suffix in headers), None)


def _fp8_problem(name: str, headers, block) -> str:
    """What is wrong with tensor ``name`` of an FP8 checkpoint (``""``: nothing): an FP8 weight
    without a scale or with one off its grid of ``block``, or a scale beside a float weight."""
    dtype, shape = headers[name]
    if name.endswith(".weight") and dtype in _FP8_DTYPES and len(shape) >= 2:
        scale = _scale_of(name, headers)
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
