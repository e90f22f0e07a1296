"""The routing traces the benchmarks replay: every trace in ``../shared/traces``.

Traces stay where they are (no redistribution licence); this only names them. A folder is
loaded as one trace (the Qwen3 windows); the Mixtral folder holds three files of two
formats, loaded one by one.
"""

from __future__ import annotations

from _common import traces_dir

from expertcache.trace import RoutingTrace, load_trace

#: (label, path relative to the traces folder)
TRACE_FILES = (
    (
        "Mixtral-8x7B raw (HumanEval/0)",
        "mixtral-8x7b-instruct-fp8__speculative-moe/routing_raw.jsonl",
    ),
    (
        "Mixtral-8x7B decode HumanEval 0-1",
        "mixtral-8x7b-instruct-fp8__speculative-moe/humaneval_2_routing.jsonl",
    ),
    (
        "Mixtral-8x7B decode GSM8K 0-1",
        "mixtral-8x7b-instruct-fp8__speculative-moe/gsm8k_2_routing.jsonl",
    ),
    (
        "Qwen1.5-MoE-A2.7B layer 0",
        "qwen1.5-moe-a2.7b-chat-gptq-int4__vllm-expert-profiler/moe_routes.jsonl",
    ),
    ("OLMoE-1B-7B layer 0", "olmoe-1b-7b-0924__cerebras-assesment2/moe_routes.jsonl"),
    ("Qwen3-30B-A3B 4 windows", "qwen3-30b-a3b-instruct-2507__local-moe-inference-stack"),
)


def load_all() -> list[tuple[str, RoutingTrace]]:
    """Every trace, labelled; raises if the traces folder is absent (see `traces_dir`)."""
    folder = traces_dir()
    return [(label, load_trace(folder / path)) for label, path in TRACE_FILES]
