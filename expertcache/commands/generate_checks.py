"""What ``expertcache generate`` checks before any weight is read, and what it reads to check.

The checkpoint directory (``config.json`` that is JSON, weight files: `check_directory`);
its config and a weightless meta-device copy of the architecture (`read_model_config`,
`build_skeleton`), on which the caller checks the MoE layers and the cache size; what
``--graphs`` needs (`check_graphs`); ``--experts-implementation``, the pin budget and the
compression against the experts' bytes and dtype (on that copy, when its experts are those
that load: not a quantized checkpoint but MXFP4, whose experts `mxfp4_blocks` puts on the copy
from the safetensors headers: `check_serving`); the prompt against the tokenizer or the
vocabulary (`load_tokenizer`, `prompt_ids`). A failure ends the command through
``parser.error`` (one line, exit status 2) or raises ValueError for the command to report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def check_graphs(args, config, device, parser: argparse.ArgumentParser) -> None:
    """What ``--graphs`` needs, checked before the weights are read."""
    if args.experts_implementation == "eager":
        parser.error(
            "--graphs cannot capture --experts-implementation eager: it finds the experts a layer hit with "
            "nonzero() on the host every layer (batched_mm and grouped_mm do not)"
        )
    if device.type != "cuda":
        where = "--device cpu" if args.device is not None else "this machine has no CUDA GPU"
        parser.error(f"--graphs captures the decode step in CUDA graphs and needs a CUDA GPU ({where})")
    if config.mode != "device":
        parser.error(
            "--graphs needs --moe-expert-cache-mode device: host mode reads routing ids on the host "
            "every layer, which a CUDA graph cannot capture"
        )
    if args.save_trace is not None:
        parser.error("--graphs cannot record a routing trace (the recorder copies ids to the host every layer)")


def check_serving(
    skeleton, blocks, config, implementation, parser: argparse.ArgumentParser, *, exact: bool = False
) -> None:
    """What would be refused once the weights are in, checked on the meta-device copy.

    ``exact``: the copy's expert blocks are those that load, quantized or not (`mxfp4_blocks`);
    otherwise a quantized config or one without a dtype skips the checks of their bytes.
    """
    from expertcache.integrations.transformers.dispatch import IMPLEMENTATION_NAME, resolve
    from expertcache.integrations.transformers.serving import check_one_layout, check_pin_budget
    from expertcache.store import check_compression

    if implementation == IMPLEMENTATION_NAME:  # transformers accepts it once the cache has registered it
        parser.error(
            f"--experts-implementation {implementation}: that is the cache itself, which runs another "
            f"implementation on the slots; name that one (eager, batched_mm, grouped_mm, expertcache_quant, ...)"
        )
    if implementation is not None:
        try:
            skeleton.set_experts_implementation(implementation)
            for block in blocks:  # a packed experts class has its own registry (Mxfp4Experts: no sonicmoe)
                resolve(block.module, implementation)
        # ValueError: transformers lists the names it accepts for this model; RuntimeError: a name it
        # takes only at load (deepgemm_megamoe); KeyError: one the block's registry does not hold
        except (ValueError, RuntimeError) as error:
            parser.error(f"--experts-implementation {implementation}: {' '.join(str(error).split())}")
        except KeyError as error:
            parser.error(f"--experts-implementation {implementation}: {error.args[0]}")
    quantized = getattr(skeleton.config, "quantization_config", None) is not None
    if not exact and (skeleton.config.dtype is None or quantized):
        return  # its experts are not those that load (dtype="auto", quantized): enabling checks those
    layouts = [_layout(block) for block in blocks]
    try:
        check_pin_budget(blocks, layouts, config.pin_budget_bytes)
        for layout in layouts:
            check_compression(config.compression, layout)
    except ValueError as error:  # PinBudgetError is one
        parser.error(str(error))
    if config.budget == "global":  # one pool of slots for every layer
        try:
            check_one_layout(blocks, layouts)
        except ValueError as error:
            parser.error(f"--moe-expert-cache-budget global: {error}")


def _layout(block):
    """The cache layout of a meta-device block's experts: stand-ins of their shapes and dtypes,
    one element of memory each (`layout_from_weights` refuses meta tensors, which hold no data)."""
    import torch

    from expertcache.layout import layout_from_weights

    parameters = {block.cache_name(name): block.module.get_parameter(name) for name in block.parameter_names}
    stand_ins = {name: torch.empty((), dtype=p.dtype).expand(p.shape) for name, p in parameters.items()}
    return layout_from_weights(stand_ins)[1]


def mxfp4_blocks(path: Path, skeleton):
    """Put on the meta-device copy the `Mxfp4Experts` that `load_mxfp4_experts` will put in the
    loaded model, from the shapes and dtypes in the checkpoint's safetensors headers (no tensor
    is read), so that what it or the cache would refuse is refused before transformers loads
    and dequantizes the whole checkpoint.

    Returns:
        ``(blocks, exact)``: the copy's expert blocks now, and whether every one of them is
        packed (its stand-ins are then exactly what will be served: `check_serving`'s ``exact``).

    Raises:
        ValueError (``--model DIR: cannot load the weights (...)``, as a refused load): no
            ``model.safetensors`` or index to read the experts from (the index not JSON, a shard
            missing or not safetensors), an experts module missing one of its six MXFP4
            tensors, blocks or scales not ``uint8`` or of the wrong shape, a dense
            ``gate_up_proj`` / ``down_proj`` beside its blocks (transformers computes with the
            dense one, the cache would serve the blocks), MXFP4 tensors for no module or for
            experts that are not GPT-OSS's.
    """
    from safetensors import SafetensorError

    from expertcache.integrations.transformers import find_expert_blocks, load_mxfp4_experts
    from expertcache.integrations.transformers.packed_models import Mxfp4Experts, mxfp4_headers

    try:
        stand_ins, _ = mxfp4_headers(path)
    except (OSError, ValueError, SafetensorError) as error:
        raise refused_load(path, error) from None
    try:
        load_mxfp4_experts(skeleton, stand_ins)
    except (ValueError, TypeError) as error:
        raise refused_load(path, str(error)) from None
    blocks = find_expert_blocks(skeleton)
    return blocks, all(isinstance(block.module, Mxfp4Experts) for block in blocks)


def refused_load(path: Path, error: BaseException | str) -> ValueError:
    """``--model DIR: cannot load the weights (<reason>)``: what a checkpoint whose files cannot
    be read (before the load or by it) is refused with; an error other than a plain ValueError
    is named by its type."""
    reason = error if isinstance(error, str) or type(error) is ValueError else f"{type(error).__name__}: {error}"
    return ValueError(f"--model {path}: cannot load the weights ({reason})")


def check_directory(path: Path, parser: argparse.ArgumentParser) -> None:
    """``--model`` is a directory with a transformers ``config.json`` and weight files."""
    if not path.exists():
        parser.error(f"--model {path}: no such directory")
    if not path.is_dir():
        parser.error(f"--model {path}: not a directory")
    if not (path / "config.json").is_file():
        parser.error(f"--model {path}: not a transformers checkpoint directory (no config.json)")
    try:
        config = json.loads((path / "config.json").read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON
        parser.error(f"--model {path}: config.json is not JSON ({error})")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        parser.error(f"--model {path}: config.json is not a transformers config (no 'model_type')")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        parser.error(f"--model {path}: no weights (*.safetensors or pytorch_model*.bin) beside config.json")


def read_model_config(auto_config, path: Path):
    """The checkpoint's transformers config. A value transformers refuses (a field of the wrong
    type, a dtype torch lacks) is bad input: transformers raises its own exception types."""
    try:
        return auto_config.from_pretrained(path)
    except (ValueError, OSError):  # an unknown model type: transformers' message says it
        raise
    except Exception as error:
        raise ValueError(f"config.json has a value transformers refuses ({type(error).__name__}: {error})") from None


def build_skeleton(model_config):
    """The architecture on the meta device: module names and shapes, no memory, no weights.

    Raises:
        ValueError: config.json's sizes do not make a model (zero heads, a layer too large):
            what transformers raises building it (ZeroDivisionError, RuntimeError, ...).
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config)
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(
            f"config.json describes no model transformers can build ({type(error).__name__}: {error})"
        ) from None


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when the directory has no tokenizer file.

    Raises:
        ValueError: a tokenizer file that does not load.
    """
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # the tokenizers library raises plain Exception for a corrupt file
        raise ValueError(f"--model {path}: cannot load the tokenizer ({type(error).__name__}: {error})") from None


def prompt_ids(prompt, tokenizer, model_config, parser):
    """``--prompt`` (a default when None) as token ids ``[1, T]`` int64 on the CPU: encoded by
    ``tokenizer``, or read as ids below the model's vocabulary size without one."""
    import torch

    if tokenizer is not None:
        ids = tokenizer(prompt if prompt is not None else "Hello", return_tensors="pt").input_ids
        if ids.numel() == 0:
            parser.error(f"--prompt {prompt!r} gives no tokens")
        return ids
    text = prompt if prompt is not None else "1 2 3 4"
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        parser.error(
            f"the model directory has no tokenizer, so --prompt must be token ids such as '1 2 3', got {text!r}"
        )
    vocab = int(model_config.vocab_size)
    if not ids or not all(0 <= i < vocab for i in ids):
        parser.error(f"--prompt token ids must be in [0, {vocab}) and not empty, got {text!r}")
    return torch.tensor([ids])


def quantization_method(model_config) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (``"mxfp4"``, ``"fp8"``, ...), or None."""
    quantization = getattr(model_config, "quantization_config", None)
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def check_quantization_method(model_config, path: Path, parser: argparse.ArgumentParser) -> None:
    """A ``quant_method`` transformers does not know (``"MXFP4"``, ``"fp4"``) is refused: it
    would skip the quantization with a warning and load the packed tensors as unknown ones,
    leaving the experts without weights."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    quantization = getattr(model_config, "quantization_config", None)
    method = quantization_method(model_config)
    if method is None or method in AUTO_QUANTIZATION_CONFIG_MAPPING:
        return  # no method at all: transformers' own refusal names it
    flags = quantization if isinstance(quantization, dict) else getattr(quantization, "__dict__", {})
    if flags.get("load_in_8bit") or flags.get("load_in_4bit"):
        return  # bitsandbytes: these flags name the method
    near = [known for known in AUTO_QUANTIZATION_CONFIG_MAPPING if known == method.strip().lower()]
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    parser.error(
        f"--model {path}: config.json's quantization_config.quant_method {method!r} is not one transformers "
        f"knows{hint}: it would load the weights as if unquantized; known: "
        f"{', '.join(sorted(AUTO_QUANTIZATION_CONFIG_MAPPING))}"
    )
