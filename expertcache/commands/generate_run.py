"""What ``expertcache generate`` does once its checks pass: load, serve, generate, report.

`load_and_generate` loads the checkpoint's weights (transformers' load output held back
until the load is accepted: `expertcache.commands.load_output`), refuses one that leaves
parameters without weights or holds expert tensors the model does not use, keeps an MXFP4
checkpoint's experts packed (transformers loads GPT-OSS dequantized where its hub kernels
are not at hand, which is everywhere offline; `load_mxfp4_experts` then puts the
checkpoint's blocks and scales back, 4x fewer bytes a miss than bf16), computes packed
experts with the project's kernels unless told otherwise, enables the expert cache
(recording the routing with ``--save-trace``), generates greedily through it (through CUDA
graphs with ``--graphs``), prints the output and the cache's figures and, with
``--compare``, generates again with every expert resident and says whether the tokens
match. What cannot load or run is a ValueError of one line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from expertcache.commands.load_output import held_load_output


def load_and_generate(args, config, blocks, tokenizer, input_ids, device, torch, *, mxfp4: bool = False) -> int:
    """Load ``args.model``, serve its experts through the cache and generate from ``input_ids``.

    Args:
        args: the parsed flags (``model``, ``max_new_tokens``, ``graphs``, ``compare``,
            ``save_trace``, ``experts_implementation``).
        config: the checked `ExpertCacheConfig`, its device the model's.
        blocks: the MoE blocks found on the meta-device copy (their experts and top-k are printed).
        tokenizer: the checkpoint's tokenizer, or None (the output is then token ids).
        input_ids: the prompt, ``[1, T]`` int64 on ``device``.
        device: the torch device the model runs on.
        torch: the torch module (imported by the caller).
        mxfp4: the checkpoint's experts are MXFP4 (``quantization_config.quant_method``).

    Returns:
        The exit status: 0, or 1 when ``--compare`` finds different tokens.

    Raises:
        ValueError: the weights cannot load, leave parameters without weights, or the experts
            implementation cannot run here.
    """
    from expertcache.integrations.transformers import enable_expert_cache
    from expertcache.trace import RoutingRecorder

    model, held = _load_weights(args.model, [block.name for block in blocks], mxfp4=mxfp4)
    model.eval()
    recorder = RoutingRecorder(source=f"expertcache generate {args.model}") if args.save_trace else None
    packed = _packed_format(model)
    implementation = _experts_implementation(args, packed)
    if implementation is not None:
        model.set_experts_implementation(implementation)  # a named one was accepted by the skeleton
    handle = enable_expert_cache(model, config, recorder=recorder)
    assert handle is not None  # config is not None
    # accepted: what transformers printed loading, then our lines (a refusal above is one line)
    held.show()
    if packed is not None:
        print(f"experts: {packed} of {len(blocks)} MoE layers, served packed")
    if implementation != args.experts_implementation:
        print(f"experts computed with {implementation} (--experts-implementation names another)")
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
    return _compare_without_cache(model, input_ids, args.max_new_tokens, run.tokens, stats.misses, torch)


def _experts_implementation(args, packed: str | None) -> str | None:
    """What the experts compute with: ``--experts-implementation``; else, for packed experts,
    the project's kernels (transformers' FP8 functions need the hub's finegrained-fp8 kernel,
    which does not load offline; `Mxfp4Experts`' default dequantizes in torch); else, with
    ``--graphs``, batched_mm (what generate() decodes with on a GPU; grouped_mm's fallbacks for
    other dtypes than bf16 sync); else the checkpoint's (None)."""
    from expertcache.integrations.transformers.quantized import QUANT_IMPLEMENTATION

    if args.experts_implementation is not None:
        return args.experts_implementation
    if packed is not None:
        return QUANT_IMPLEMENTATION
    return "batched_mm" if args.graphs else None


def _packed_format(model) -> str | None:
    """What the loaded experts hold when they are packed (transformers keeps an FP8
    checkpoint's experts packed on a GPU and dequantizes them without one), else None."""
    from expertcache.integrations.transformers import find_expert_blocks
    from expertcache.integrations.transformers.packed_models import Mxfp4Experts
    from expertcache.integrations.transformers.quantized import is_quantized

    modules = [block.module for block in find_expert_blocks(model)]
    if modules and all(isinstance(module, Mxfp4Experts) for module in modules):
        return "MXFP4 blocks and scales"
    if modules and all(is_quantized(module) for module in modules):
        return "FP8 values and scales"
    return None


def _load_weights(path: Path, experts: list[str], *, mxfp4: bool):
    """The checkpoint's model with its weights, refused (ValueError, one line) when it cannot
    load, leaves parameters without weights or holds expert tensors the model does not use;
    with ``mxfp4``, its experts packed.

    Args:
        path: the checkpoint directory.
        experts: the names of the model's experts modules.
        mxfp4: the checkpoint's experts are MXFP4 blocks and scales.

    Returns:
        ``(model, held)``: the model and what transformers printed while loading (held back:
        the caller shows it once the cache accepts the model, so that a refusal until then is
        one line).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import Mxfp4Config

    from expertcache.integrations.transformers import load_mxfp4_experts

    # MXFP4: dequantized by transformers (the hub's kernels are not needed), then packed again below
    quantization = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}

    # what transformers prints while loading (its load report, warnings) is held back: a refused load
    # prints one line, ours (with the report's rows when transformers raised); an accepted one shows
    # it all once the cache is enabled, as transformers would have. Its progress bar shows only on a
    # terminal (see load_output).
    with held_load_output(progress=sys.stderr.isatty()) as held:
        try:
            # output_loading_info: (model, what was missing...), which transformers' overloads do not type
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                path, dtype="auto", output_loading_info=True, **quantization
            )
        # a corrupt checkpoint; ImportError: a quantization whose package is missing (mxfp4 needs accelerate)
        except (OSError, ValueError, RuntimeError, KeyError, ImportError, SafetensorError) as error:
            report = held.summary()
            raise ValueError(
                f"--model {path}: cannot load the weights ({type(error).__name__}: {error})"
                + (f"; transformers' load report: {report}" if report else "")
            ) from None
    model, loading = loaded
    _check_nothing_missing(path, loading["missing_keys"])
    _check_experts_use_everything(path, experts, loading["unexpected_keys"])
    if mxfp4:
        load_mxfp4_experts(model, path)
    return model, held


def _compare_without_cache(model, input_ids, max_new_tokens, cached_tokens, misses, torch) -> int:
    """``--compare``: generate again with every expert resident (the cache disabled) and say
    whether the tokens match ``cached_tokens``; the exit status, 1 when they differ."""
    from expertcache.integrations.transformers.generation import greedy_generate

    resident = greedy_generate(model, input_ids, max_new_tokens, stop_at_eos=True, progress="no cache")
    same = bool(torch.equal(resident.tokens, cached_tokens))
    print(f"without the cache: {'identical tokens' if same else 'DIFFERENT tokens'}")
    if not same and misses:
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


def _check_experts_use_everything(path: Path, experts: list[str], unexpected) -> None:
    """Refuse a checkpoint holding tensors of an experts module that the module does not use
    (an FP8 scale under another name, biases for experts without them): transformers drops
    them with a report and computes the experts without them, so the cache would serve
    weights that are not the checkpoint's."""
    prefixes = tuple(f"{name}." for name in experts)
    unused = sorted(key for key in unexpected if key.startswith(prefixes))
    if unused:
        shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        raise ValueError(
            f"--model {path}: the checkpoint holds {len(unused)} expert tensors the model does not use ({shown}); "
            f"transformers would compute the experts without them"
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
