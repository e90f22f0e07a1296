"""The landing kernels lower to Triton IR for an sm_90 GPU on a machine without one.

The other tests run kernels in Triton's interpreter on a CPU, which checks no types: a
loop-carried value that changes type (an int32 count grown by an int64) runs there and
fails to compile on the GPU (it did, in run 93). Lowering each kernel's frontend to Triton
IR runs the compiler's checks without a GPU. On a GPU machine the GPU tests compile every
kernel for real, so this test runs where there is none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# (module, kernel, pointer dtypes, constexprs); every other argument is an int32 scalar
KERNELS = [
    ("copy_experts", "_copy_experts_kernel",
     {"source_ptr": "*i32", **{f"slots{i}": "*i32" for i in range(8)}, "count_ptr": "*i32",
      "experts_ptr": "*i32", "slot_ids_ptr": "*i32", "landed_ptr": "*i32"},
     {"BLOCK": 4096, "NUM_PROGRAMS": 64, "NUM_SEGMENTS": 8, "ALIGN": 4, "PDL": True, "SIGNAL": True}),
    ("expert_apply", "_gate_up_kernel",
     {"hidden_ptr": "*bf16", "w1_ptr": "*bf16", "scale_ptr": "*fp32", "ids_ptr": "*i32", "act_ptr": "*fp32",
      "landed_ptr": "*i32", "done_ptr": "*i32"},
     {"BLOCK_I": 8, "BLOCK_H": 128, "HAS_SCALE": True, "SCALE_BLOCK": 128, "PDL": True, "WAIT": True}),
    ("expert_apply", "_down_kernel",
     {"act_ptr": "*fp32", "w2_ptr": "*bf16", "scale_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32",
      "part_ptr": "*fp32", "done_ptr": "*i32", "landed_ptr": "*i32"},
     {"BLOCK_H": 16, "BLOCK_I": 256, "HAS_SCALE": True, "SCALE_BLOCK": 128, "WRITE_ALL": False, "PDL": True,
      "WAIT": True}),
    ("grouped_apply", "_gate_up_kernel",
     {"hidden_ptr": "*bf16", "w1_ptr": "*bf16", "pair_ptr": "*i32", "expert_ptr": "*i32", "act_ptr": "*bf16",
      "landed_ptr": "*i32"},
     {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "FP32_DOT": False, "WAIT": True}),
]  # fmt: skip

# Run with the interpreter off (its kernels are not the compiler's), in a fresh process.
_LOWER = """
import importlib, inspect, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton._C.libtriton import ir

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({})
failures = []
for module, name, pointers, constexprs in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(f"expertcache.kernels.{module}"), name)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constexprs.items()})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    arguments = [options, backend.get_codegen_implementation(options), backend.get_module_map(), context]
    if "target" in inspect.signature(source.make_ir).parameters:
        arguments.insert(0, target)
    try:
        source.make_ir(*arguments)
    except Exception as error:
        failures.append(f"{module}.{name}: {type(error).__name__}: {error}")
print(json.dumps(failures))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile every kernel for real here")
def test_landing_kernels_lower_to_triton_ir_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _LOWER, json.dumps(KERNELS)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert failures == [], "\n".join(failures)
