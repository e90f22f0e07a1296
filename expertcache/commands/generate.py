"""``expertcache generate``: greedy generation from a local checkpoint with the expert cache.

Everything that can be wrong with the request is checked before any weight is read: the
flags (a device that exists, a mode this machine runs, a writable ``--save-trace`` that is
none of the checkpoint's files), the directory (``config.json`` that is JSON, weight
files), the model's MoE layers (on a weightless meta-device copy of the architecture) and
the cache size against them, ``--experts-implementation``, the pin budget and the
compression against the experts' bytes and dtype (on that copy, when its experts are those
that load: not a quantized checkpoint), the prompt against the tokenizer or the vocabulary
and, with ``--max-new-tokens``, against the model's positions. Each failure is one line,
exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from expertcache.cli import add_cache_arguments, cache_config_from_args
from expertcache.commands.arguments import check_sequence_length, device_name, input_path, output_file, positive_int
from expertcache.commands.files import check_distinct
from expertcache.commands.load_output import held_load_output

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate from a local checkpoint directory with the expert cache",
        description="Load a transformers checkpoint directory (from_pretrained on a path), serve "
        "its experts through the cache and generate greedily.",
    )
    parser.add_argument("--model", required=True, type=input_path, metavar="DIR", help="checkpoint dir")
    parser.add_argument(
        "--prompt",
        default=None,
        help="text (with a tokenizer in DIR) or token ids such as '1 2 3' (without one)",
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N")
    parser.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="then generate again with every expert resident and check the tokens match",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="decode with each step replayed from a CUDA graph (GraphedGenerator; needs a CUDA GPU and "
        "--moe-expert-cache-mode device; experts computed with transformers' batched_mm unless "
        "--experts-implementation says otherwise)",
    )
    parser.add_argument(
        "--experts-implementation",
        default=None,
        metavar="NAME",
        help="transformers experts implementation to compute with (default: the checkpoint's; with --graphs "
        "batched_mm); batched_mm and expertcache_quant (the project's kernels) are bit-identical to the uncached "
        "model when a prompt runs in several expert-group passes",
    )
    parser.add_argument(
        "--save-trace",
        type=output_file(),
        default=None,
        metavar="FILE.npz",
        help="write the recorded routing trace to exactly this file (an .npz archive)",
    )
    add_cache_arguments(parser, size_required=True)
    parser.set_defaults(func=lambda args: run(args, parser))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = cache_config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if config is None:
        parser.error("generate needs --moe-expert-cache-size N (GPU slots per MoE layer)")
    if args.prompt is not None and not args.prompt.strip():
        parser.error("--prompt is empty")
    _check_directory(args.model, parser)
    if args.save_trace is not None:
        check_distinct({"--save-trace": args.save_trace}, {"--model": sorted(args.model.iterdir())})
    import torch
    from transformers import AutoConfig

    from expertcache.config import check_mode_runs_here
    from expertcache.integrations.transformers import check_cache_size
    from expertcache.validation import resolve_device

    try:
        device = resolve_device(args.device)
        check_mode_runs_here(config.mode, device)
        model_config = _model_config(AutoConfig, args.model)
        skeleton = _skeleton(model_config)
        blocks = check_cache_size(skeleton, config.cache_size)
    except (ValueError, OSError) as error:  # unknown model type, no MoE layers, size out of range
        parser.error(f"{args.model}: {error}")
    slots = getattr(args, "moe_expert_cache_device", None)
    if slots is not None and resolve_device(slots) != device:
        parser.error(
            f"--moe-expert-cache-device {slots} differs from the model's --device {device}: the experts are "
            f"computed where the model runs, so the slots must be there too (drop one of the flags)"
        )
    if args.graphs:
        _check_graphs(args, config, device, parser)
    _check_serving(skeleton, blocks, config, args.experts_implementation, parser)
    tokenizer = _tokenizer(args.model)
    input_ids = _prompt_ids(args.prompt, tokenizer, model_config, parser).to(device)
    check_sequence_length(model_config, input_ids.shape[1], args.max_new_tokens, "--max-new-tokens")
    config = dataclasses.replace(config, device=str(device))
    return _generate(args, config, blocks, tokenizer, input_ids, device, torch)


def _check_graphs(args, config, device, parser: argparse.ArgumentParser) -> None:
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


def _check_serving(skeleton, blocks, config, implementation, parser: argparse.ArgumentParser) -> None:
    """What would be refused once the weights are in, checked on the meta-device copy."""
    from expertcache.integrations.transformers.dispatch import IMPLEMENTATION_NAME
    from expertcache.integrations.transformers.serving import check_pin_budget
    from expertcache.store import check_compression

    if implementation == IMPLEMENTATION_NAME:  # transformers accepts it once the cache has registered it
        parser.error(
            f"--experts-implementation {implementation}: that is the cache itself, which runs another "
            f"implementation on the slots; name that one (eager, batched_mm, grouped_mm, expertcache_quant, ...)"
        )
    if implementation is not None:
        try:
            skeleton.set_experts_implementation(implementation)
        except ValueError as error:  # transformers lists the names it accepts for this model
            parser.error(f"--experts-implementation {implementation}: {error}")
    if skeleton.config.dtype is None or getattr(skeleton.config, "quantization_config", None) is not None:
        return  # its experts are not those that load (dtype="auto", quantized): enabling checks those
    layouts = [_layout(block) for block in blocks]
    try:
        check_pin_budget(blocks, layouts, config.pin_budget_bytes)
        for layout in layouts:
            check_compression(config.compression, layout)
    except ValueError as error:  # PinBudgetError is one
        parser.error(str(error))


def _layout(block):
    """The cache layout of a meta-device block's experts: stand-ins of their shapes and dtypes,
    one element of memory each (`layout_from_weights` refuses meta tensors, which hold no data)."""
    import torch

    from expertcache.layout import layout_from_weights

    parameters = {block.cache_name(name): block.module.get_parameter(name) for name in block.parameter_names}
    stand_ins = {name: torch.empty((), dtype=p.dtype).expand(p.shape) for name, p in parameters.items()}
    return layout_from_weights(stand_ins)[1]


def _check_directory(path: Path, parser: argparse.ArgumentParser) -> None:
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


def _model_config(auto_config, path: Path):
    """The checkpoint's transformers config. A value transformers refuses (a field of the wrong
    type, a dtype torch lacks) is bad input: transformers raises its own exception types."""
    try:
        return auto_config.from_pretrained(path)
    except (ValueError, OSError):  # an unknown model type: transformers' message says it
        raise
    except Exception as error:
        raise ValueError(f"config.json has a value transformers refuses ({type(error).__name__}: {error})") from None


def _skeleton(model_config):
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


def _tokenizer(path: Path):
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # the tokenizers library raises plain Exception for a corrupt file
        raise ValueError(f"--model {path}: cannot load the tokenizer ({type(error).__name__}: {error})") from None


def _prompt_ids(prompt, tokenizer, model_config, parser):
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


def _generate(args, config, blocks, tokenizer, input_ids, device, torch) -> int:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from expertcache.integrations.transformers import enable_expert_cache
    from expertcache.integrations.transformers.generation import greedy_generate
    from expertcache.trace import RoutingRecorder

    # what transformers prints while loading (its load report, warnings) is held back: a refused load
    # prints one line, ours (with the report's rows when transformers raised); an accepted one shows
    # it all now, as transformers would have. Its progress bar shows only on a terminal (see load_output).
    with held_load_output(progress=sys.stderr.isatty()) as held:
        try:
            # output_loading_info: (model, what was missing...), which transformers' overloads do not type
            loaded: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", output_loading_info=True)
        # a corrupt checkpoint; ImportError: a quantization whose package is missing (mxfp4 needs accelerate)
        except (OSError, ValueError, RuntimeError, KeyError, ImportError, SafetensorError) as error:
            report = held.summary()
            raise ValueError(
                f"--model {args.model}: cannot load the weights ({type(error).__name__}: {error})"
                + (f"; transformers' load report: {report}" if report else "")
            ) from None
    model, loading = loaded
    _check_nothing_missing(args.model, loading["missing_keys"])
    held.show()
    model.eval()
    recorder = RoutingRecorder(source=f"expertcache generate {args.model}") if args.save_trace else None
    if args.experts_implementation is not None:
        model.set_experts_implementation(args.experts_implementation)  # accepted by the skeleton
    elif args.graphs:
        # what generate() decodes with on a GPU; grouped_mm's fallbacks (non-bf16) sync
        model.set_experts_implementation("batched_mm")
    handle = enable_expert_cache(model, config, recorder=recorder)
    assert handle is not None  # config is not None
    model.to(device)  # everything but the experts, which now live in the store and the slots
    experts = blocks[0].num_experts
    top_k = getattr(blocks[0].module.config, "num_experts_per_tok", "?")
    print(
        f"model: {args.model} ({model.config.model_type}, {len(blocks)} MoE layers x {experts} "
        f"experts, top-{top_k}), {str(model.dtype).removeprefix('torch.')} on {device}"
    )
    print(
        f"cache: {config.cache_size} slots per layer, budget {config.budget}, {config.policy}; "
        f"expert bytes on device {handle.slot_bytes / 1e6:.1f} MB vs "
        f"{handle.expert_bytes / 1e6:.1f} MB fully resident"
    )
    if recorder is not None:
        recorder.begin_request()
    run = _cached_run(args, model, input_ids)
    _print_output(run, input_ids, tokenizer)
    stats = handle.stats.total
    print(
        f"{run.new_tokens} new tokens in {run.seconds:.2f} s ({run.tokens_per_second:.1f} tok/s); "
        f"hit rate {stats.hit_rate:.1%} ({stats.hits} hits, {stats.misses} misses), "
        f"{stats.bytes_h2d / 1e6:.1f} MB copied into slots"
    )
    if recorder is not None:
        trace = recorder.trace()
        written = trace.save(args.save_trace)
        shape = f"{trace.num_tokens} tokens x {trace.num_layers} layers"
        print(f"routing trace: {shape} -> {written}")
    if not args.compare:
        return 0
    handle.disable()
    model.to(device)
    resident = greedy_generate(model, input_ids, args.max_new_tokens, stop_at_eos=True, progress="no cache")
    same = bool(torch.equal(resident.tokens, run.tokens))
    print(f"without the cache: {'identical tokens' if same else 'DIFFERENT tokens'}")
    if not same and stats.misses:
        print(
            "(a prompt needing more experts than the slots runs in passes; transformers' implementations other "
            "than batched_mm sum them after rounding, which can change a greedy token: --experts-implementation "
            "batched_mm or expertcache_quant is bit-identical)"
        )
    return 0 if same else 1


def _check_nothing_missing(path: Path, missing) -> None:
    """Refuse a checkpoint without weights for some of the model's parameters: transformers
    starts those at random and generates from them (it only prints a report)."""
    if missing:
        names = sorted(missing)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"--model {path}: the checkpoint has no weights for {len(names)} of the model's parameters "
            f"({shown}); transformers would start them at random"
        )


def _cached_run(args, model, input_ids):
    """The generation through the cache. An experts implementation that cannot run here (a
    kernel it imports is missing: transformers' sonicmoe off CUDA, a hub kernel) raises
    ImportError at its first call: bad input, one line, not a traceback."""
    from expertcache.integrations.transformers.generation import greedy_generate

    try:
        if args.graphs:
            return _graphed_run(model, input_ids, args.max_new_tokens)
        return greedy_generate(model, input_ids, args.max_new_tokens, stop_at_eos=True, progress="generate")
    except ImportError as error:
        name = args.experts_implementation or ("batched_mm" if args.graphs else None)
        which = f"the experts implementation {name!r}" if name else "the model's experts implementation"
        raise ValueError(f"{which} cannot run here ({error}); choose another with --experts-implementation") from None


def _graphed_run(model, input_ids, max_new_tokens):
    """Greedy decoding to EOS (as greedy_generate with stop_at_eos) through CUDA graphs."""
    from expertcache.integrations.transformers.graphed import GraphedGenerator, timed_generate

    runner = GraphedGenerator(model, max_length=input_ids.shape[1] + max_new_tokens, graphs=True)
    generation = model.generation_config
    eos = generation.eos_token_id
    pad = None if eos is None else generation.pad_token_id or 0  # as greedy_generate; without EOS none is used
    run = timed_generate(runner, input_ids, max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    buckets = ", ".join(map(str, runner.captured_buckets)) or "none (fewer steps than the warm-up)"
    print(f"decode: CUDA graphs captured for batch bucket {buckets}; {runner.replays} replays")
    return run  # the runner (and its graphs, which hold the slots' addresses) goes before disable()


def _print_output(run, input_ids, tokenizer) -> None:
    new = run.tokens[0, input_ids.shape[1] :]
    if tokenizer is not None:
        print(f"output: {tokenizer.decode(new, skip_special_tokens=True)!r}")
    else:
        print(f"output token ids: {new.tolist()}")
