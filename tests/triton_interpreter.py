"""Test set-up: skip the Triton interpreter's repeated patching of ``triton.language``.

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` with the
interpreter's versions of its builtins and puts them back when the launch ends. Every call of
a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``) patches them
once more, walking the language modules with ``inspect.getmembers``: the launch's own patches
are still in place, so this changes nothing, yet it was 29% of two interpreted test files' time
(cProfile of ``tests/test_quant_apply.py`` and ``tests/test_equivalence.py``: 159,591 helper
calls against 5,443 launches).

`install` wraps the interpreter's launch (``GridExecutor.__call__``) and ``_patch_lang``: the
launch's own patching runs Triton's code and records which language modules it covered;
while that launch runs, a helper call whose module sees only those returns without patching
again; every other call runs Triton's own. The kernels run the same interpreted code either
way. Where the interpreter lacks what this relies on (another Triton version), nothing is
installed and it runs as shipped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable


def install() -> bool:
    """Wrap the interpreter's launch and ``_patch_lang`` (once); True where they are wrapped."""
    try:
        from triton import language
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if getattr(original, "skips_repeats", False):
        return True
    launch_class = getattr(interpreter, "GridExecutor", None)
    if original is None or launch_class is None or list(inspect.signature(original).parameters) != ["fn"]:
        return False
    launch = launch_class.__call__
    covers: list[frozenset[int] | None] = []  # per running launch: the modules it patched (None: not yet)

    def modules_of(fn: Callable) -> frozenset[int]:
        seen = fn.__globals__.values()
        return frozenset(id(value) for value in seen if value is language or value is language.core)

    def patch_lang(fn: Callable) -> object:
        cover = covers[-1] if covers else frozenset()
        if cover is None:  # the launch's own patching
            covers[-1] = modules_of(fn)
            return original(fn)
        if cover and modules_of(fn) <= cover:  # a helper: the launch's patches still hold
            return None  # (a helper call discards what this returns)
        return original(fn)

    def launch_recording_its_patches(self, *args, **kwargs):
        covers.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            covers.pop()

    patch_lang.skips_repeats = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    launch_class.__call__ = launch_recording_its_patches
    return True
