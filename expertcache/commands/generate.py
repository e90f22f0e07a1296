"""``expertcache generate``: greedy generation from a local checkpoint with the expert cache.

Everything that can be wrong with the request is checked before any weight is read: the
flags (a device that exists, a mode this machine runs, a writable ``--save-trace`` that is
none of the checkpoint's files), the directory (``config.json`` that is JSON, weight
files), the model's MoE layers (on a weightless meta-device copy of the architecture) and
the cache size against them, ``--experts-implementation``, the pin budget and the
compression against the experts' bytes and dtype (on that copy, when its experts are those
that load: not a quantized checkpoint, but a GPT-OSS MXFP4 one, whose packed experts the
copy is given from the safetensors headers), the prompt against the tokenizer or the
vocabulary and, with ``--max-new-tokens``, against the model's positions, and a
``quant_method`` transformers does not know (it would load the packed tensors as unknown
ones), and an FP8 checkpoint's weights against its scales (from the safetensors headers:
`expertcache.commands.fp8_checks`). Each failure is one line, exit status 2. A GPT-OSS MXFP4 checkpoint is served packed
(`generate_run`).

This module owns the flags (`register`) and the order of the work (`run`); the checks and
what they read are `expertcache.commands.generate_checks`, the load and the generation
once they pass `expertcache.commands.generate_run`.
"""

from __future__ import annotations

import argparse
import dataclasses

from expertcache.cli import add_cache_arguments, cache_config_from_args
from expertcache.commands.arguments import check_sequence_length, device_name, input_path, output_file, positive_int
from expertcache.commands.files import check_distinct
from expertcache.commands.fp8_checks import check_fp8_scales
from expertcache.commands.generate_checks import (
    build_skeleton,
    check_directory,
    check_graphs,
    check_quantization_method,
    check_serving,
    load_tokenizer,
    mxfp4_blocks,
    prompt_ids,
    quantization_method,
    read_model_config,
)
from expertcache.commands.generate_run import load_and_generate


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
        help="transformers experts implementation to compute with (default: packed FP8 or MXFP4 experts "
        "expertcache_quant, else the checkpoint's, with --graphs batched_mm); batched_mm and expertcache_quant "
        "(the project's kernels) are bit-identical to the uncached model when a prompt runs in several "
        "expert-group passes",
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
    check_directory(args.model, parser)
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
        model_config = read_model_config(AutoConfig, args.model)
        skeleton = build_skeleton(model_config)
        blocks = check_cache_size(skeleton, config.cache_size)
    except (ValueError, OSError) as error:  # unknown model type, no MoE layers, size out of range
        parser.error(f"{args.model}: {error}")
    check_quantization_method(model_config, args.model, parser)
    slots = getattr(args, "moe_expert_cache_device", None)
    if slots is not None and resolve_device(slots) != device:
        parser.error(
            f"--moe-expert-cache-device {slots} differs from the model's --device {device}: the experts are "
            f"computed where the model runs, so the slots must be there too (drop one of the flags)"
        )
    if args.graphs:
        check_graphs(args, config, device, parser)
    mxfp4 = quantization_method(model_config) == "mxfp4"
    # MXFP4: the checks run on the packed experts that will be served, before the checkpoint loads
    served, exact = mxfp4_blocks(args.model, skeleton) if mxfp4 else (blocks, False)
    check_fp8_scales(args.model, model_config)  # FP8: weights against scales, from the headers
    check_serving(skeleton, served, config, args.experts_implementation, parser, exact=exact)
    tokenizer = load_tokenizer(args.model)
    input_ids = prompt_ids(args.prompt, tokenizer, model_config, parser).to(device)
    check_sequence_length(model_config, input_ids.shape[1], args.max_new_tokens, "--max-new-tokens")
    config = dataclasses.replace(config, device=str(device))
    return load_and_generate(args, config, blocks, tokenizer, input_ids, device, torch, mxfp4=mxfp4)
