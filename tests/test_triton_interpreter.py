"""The test set-up's interpreter shim (`triton_interpreter`): helpers inside a launch no longer
re-patch ``triton.language``, and kernels compute what they computed before."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from triton_interpreter import install

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the shim serves the Triton interpreter (no GPU)"
)


@triton.jit
def _twice(x, FAIL: tl.constexpr):
    tl.static_assert(FAIL == 0, "asked to fail")
    return x * 2


@triton.jit
def _with_helpers(x_ptr, out_ptr, FAIL: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, _twice(_twice(x, FAIL), FAIL) + 1)


@triton.jit
def _without_helpers(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * 4 + 1)


def _count_patches(monkeypatch) -> list[int]:
    """Counts the interpreter's walks over the language modules (its costly part)."""
    from triton.runtime import interpreter

    count = [0]
    walk = interpreter._patch_builtin

    def counting(*args, **kwargs):
        count[0] += 1
        return walk(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    return count


def test_helpers_inside_a_launch_patch_nothing_more(monkeypatch):
    assert install() is True  # conftest installed it; installing again keeps the one wrapper
    x = torch.arange(64, dtype=torch.float32)
    out = torch.empty_like(x)
    count = _count_patches(monkeypatch)
    _without_helpers[(4,)](x, out, BLOCK=16)
    one_launch = count[0]
    assert one_launch > 0 and torch.equal(out, x * 4 + 1)
    out.zero_()
    _with_helpers[(4,)](x, out, FAIL=0, BLOCK=16)  # 8 helper calls
    assert count[0] == 2 * one_launch  # Triton's own: as many again at each of the 8 helper calls
    assert torch.equal(out, x * 4 + 1)


def test_the_language_is_put_back_after_a_launch_and_after_a_failing_one():
    load, store = tl.load, tl.store
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty_like(x)
    with pytest.raises(Exception, match="asked to fail"):
        _with_helpers[(1,)](x, out, FAIL=1, BLOCK=16)  # raises inside a helper
    assert (tl.load, tl.store) == (load, store)
    _with_helpers[(1,)](x, out, FAIL=0, BLOCK=16)  # the failed launch left no cover behind
    assert torch.equal(out, x * 4 + 1) and (tl.load, tl.store) == (load, store)
