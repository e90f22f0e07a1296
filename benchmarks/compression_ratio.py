"""Compressed / raw bytes of `expertcache.compression` records, on a CPU (no timing).

Normal weights at scales 0.002 .. 0.1 and the experts of every random family
(`expertcache.integrations.transformers.random_models`), for each code (first-level bits,
second-level bits, 0 for none) and block size: the numbers the default code (2 + 3 bits,
8192 values a block) was picked by. Prints a table;
``--csv FILE`` appends rows.

    python benchmarks/compression_ratio.py [--csv FILE]
"""

from __future__ import annotations

import argparse
import csv
import time

import torch

from expertcache.exponent_analysis import analyse
from expertcache.exponent_code import ExponentCode

SCALES = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
#: (code_bits, second_bits, block)
CODES = (
    (2, 0, 8192),
    (3, 0, 8192),
    (4, 0, 8192),
    (3, 3, 8192),
    (2, 2, 8192),
    (2, 3, 4096),
    (2, 3, 8192),
    (2, 3, 16384),
)


def ratio(tensor: torch.Tensor, code_bits: int, second_bits: int, block: int) -> float:
    fmt = analyse(tensor, ExponentCode(tensor.dtype, code_bits, block, second_bits=second_bits)).format
    return fmt.record_bytes / fmt.raw_bytes


def normal_rows(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    for scale in SCALES:  # 16 experts of 1536 x 1024 (Qwen3-30B-A3B-like rows)
        yield f"randn*{scale}", (torch.randn(16, 768, 1024, generator=generator) * scale).to(dtype)


def family_rows(dtype: torch.dtype, init_std: float):
    from expertcache.integrations.transformers.discovery import find_expert_blocks
    from expertcache.integrations.transformers.random_models import FAMILIES, ModelSizes, random_model

    sizes = ModelSizes(num_moe_layers=1, num_experts=8, hidden=512, intermediate=384, vocab=128)
    for family in FAMILIES:
        model = random_model(family, sizes, dtype=dtype, init_std=init_std)
        block = find_expert_blocks(model)[0]
        for name in block.parameter_names:
            tensor = block.module.get_parameter(name).detach()
            if tensor.dtype == dtype:
                yield f"{family}.{name} std={init_std}", tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="append rows to this CSV file")
    args = parser.parse_args()
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        sources = [*normal_rows(dtype), *family_rows(dtype, 0.3), *family_rows(dtype, 0.02)]
        for label, tensor in sources:
            start = time.perf_counter()
            ratios = [ratio(tensor, bits, second, block) for bits, second, block in CODES]
            rows.append([str(dtype).removeprefix("torch."), label, tuple(tensor.shape), *ratios])
            seconds = time.perf_counter() - start
            print(f"{rows[-1][0]:>9} {label:<40} " + " ".join(f"{r:.4f}" for r in ratios) + f"  ({seconds:.1f}s)")
    header = ["dtype", "tensor", "shape", *(f"bits{b}+{s}_block{n}" for b, s, n in CODES)]
    print("columns:", " ".join(header[3:]))
    if args.csv:
        with open(args.csv, "a", newline="") as handle:
            csv.writer(handle).writerows([header, *rows])


if __name__ == "__main__":
    main()
