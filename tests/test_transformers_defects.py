"""Defects of the transformers integration (issue 12), each pinned by the behaviour it broke.

1. A pool larger than an experts implementation handles (a global budget over many
   layers) is compacted per pass: grouped_mm never sees more than 1024 groups, eager never
   builds ``one_hot(ids, S + 1)``; inside a graph the compacted size is fixed.
2. No -1 id reaches any implementation transformers offers, eagerly or in the no-sync branch.
3. ``disable(to=...)`` is all or nothing, and can put the experts in host memory.
4. ``--moe-expert-cache-device``: the slots go to the GPU by default when there is one.
5. ``set_experts_implementation`` while served is followed; a dtype change is refused.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
from transformers_helpers import TINY, logits_of, prompt, tiny_model

import expertcache.integrations.transformers.handle as handle_module
from expertcache.cli import CommandLineParser, add_cache_arguments, cache_config_from_args, main
from expertcache.integrations.transformers import IMPLEMENTATION_NAME, enable_expert_cache
from expertcache.integrations.transformers.random_models import ModelSizes, random_model
from expertcache.integrations.transformers.slot_view import GROUPED_MM_MAX_GROUPS, compact_slots
from expertcache.kernels._launch import INTERPRETED

#: Every experts implementation this transformers registers, and its own forward.
IMPLEMENTATIONS = ["eager", *sorted(name for name in ALL_EXPERTS_FUNCTIONS if name != IMPLEMENTATION_NAME)]

#: 2 layers x 520 slots = a global pool of 1040 > 1024 slots; experts tiny so it stays cheap.
WIDE = ModelSizes(num_moe_layers=2, num_experts=600, top_k=2, hidden=16, intermediate=8)
WIDE_CACHE = 520

#: 3 layers x 4 slots = a global pool of 12 > 8 experts per layer.
THREE = ModelSizes(num_moe_layers=3, num_experts=8, top_k=2)


def _expert_weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "experts" in name}


def _same_weights(model, snapshot, *, dtype=None) -> bool:
    now = dict(model.named_parameters())
    return all(
        torch.equal(now[name].detach(), value if dtype is None else value.to(dtype)) for name, value in snapshot.items()
    )


def _close(cached, reference):
    scale = reference.abs().max().item()
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5 * scale)


@pytest.fixture
def fake_compiling(monkeypatch):
    """Run the integration's no-sync branch (the one CUDA-graph capture takes) on the CPU:
    ``torch.compiler.is_compiling`` answers True for as long as the test says."""
    state = {"on": False}
    real = torch.compiler.is_compiling
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: state["on"] or real())
    return state


def _spy_on_implementation(monkeypatch, name: str, calls: list) -> None:
    """Record what the registered implementation ``name`` is handed (``eager``: through the
    one_hot it builds, which refuses -1 by itself)."""
    if name == "eager":
        real_one_hot = F.one_hot

        def one_hot(ids, num_classes=-1):
            calls.append((int(ids.min()), int(ids.max()), num_classes))
            return real_one_hot(ids, num_classes)

        monkeypatch.setattr(F, "one_hot", one_hot)
        return
    real = ALL_EXPERTS_FUNCTIONS[name]

    def spy(self, hidden_states, top_k_index, top_k_weights):
        calls.append((int(top_k_index.min()), int(top_k_index.max()), int(self.num_experts)))
        return real(self, hidden_states, top_k_index, top_k_weights)

    monkeypatch.setitem(ExpertsInterface._global_mapping, name, spy)


# -- 1. pools larger than an implementation handles -----------------------------------------


def test_a_global_pool_over_1024_slots_runs_grouped_mm(monkeypatch):
    model = random_model("qwen3_moe", WIDE)
    model.set_experts_implementation("grouped_mm")
    tokens = prompt(12)
    reference = logits_of(model, tokens)
    groups: list[int] = []
    real_grouped_mm = F.grouped_mm

    def grouped_mm(input, weight, *args, **kwargs):  # what torch's CUDA kernel refuses
        groups.append(weight.shape[0])
        if weight.shape[0] > GROUPED_MM_MAX_GROUPS:
            raise RuntimeError("Can't process more than 1024 groups")
        return real_grouped_mm(input, weight, *args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", grouped_mm)
    handle = enable_expert_cache(model, cache_size=WIDE_CACHE, budget="global")
    assert handle.provider(handle.layers[0]).pool.num_slots == 2 * WIDE_CACHE > GROUPED_MM_MAX_GROUPS
    groups.clear()
    _close(logits_of(model, tokens), reference)
    # only the slots each pass uses: at most its 12 x 2 ids, never the pool
    assert groups and max(groups) <= 12 * WIDE.top_k
    handle.disable()


def test_eager_on_a_global_pool_builds_no_pool_wide_one_hot(monkeypatch):
    model = random_model("qwen3_moe", WIDE)
    model.set_experts_implementation("eager")
    tokens = prompt(12)
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=WIDE_CACHE, budget="global")
    calls: list = []
    _spy_on_implementation(monkeypatch, "eager", calls)
    _close(logits_of(model, tokens), reference)
    # one one-hot per layer, as wide as the distinct experts of the call (+1), not 1041
    assert len(calls) == WIDE.num_moe_layers
    assert all(width <= 12 * WIDE.top_k + 1 for _, _, width in calls)
    handle.disable()


@pytest.mark.skipif(not INTERPRETED, reason="device mode on the CPU needs TRITON_INTERPRET=1")
def test_the_no_sync_branch_compacts_to_a_fixed_size(monkeypatch, fake_compiling):
    model = random_model("qwen3_moe", THREE)
    model.set_experts_implementation("eager")
    tokens = prompt(12)
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4, budget="global", mode="device")
    assert handle.provider(handle.layers[0]).pool.num_slots == 12 > THREE.num_experts
    calls: list = []
    _spy_on_implementation(monkeypatch, "eager", calls)
    fake_compiling["on"] = True
    _close(logits_of(model, tokens), reference)
    fake_compiling["on"] = False
    # min(E = 8, T*K = 24, S = 12) = 8 slots whatever the routing: a shape a graph can keep
    # (eager's one_hot takes N + 1 classes on transformers 5.24, N on 5.17)
    widths = {width for _, _, width in calls}
    assert calls and widths in ({THREE.num_experts + 1}, {THREE.num_experts})
    handle.disable()


@pytest.mark.parametrize(
    "ids, size",
    [
        ([[5, 9], [9, 2]], 4),  # duplicates; one unused table entry
        ([[7, 7], [7, 7]], 3),  # a single slot
        ([[3, 1, 2]], 3),  # every entry used
        ([[1040, 0]], 2),  # ids far beyond the table size
    ],
)
def test_compact_slots_renumbers_into_a_fixed_table(ids, size):
    ids = torch.tensor(ids)
    table, local = compact_slots(ids, size)
    assert table.shape == (size,) and local.shape == ids.shape
    assert torch.equal(table[local], ids)
    distinct = torch.unique(ids)
    assert torch.equal(table[: distinct.numel()], distinct)
    assert torch.equal(table[distinct.numel() :], distinct[:1].expand(size - distinct.numel()))


# -- 2. no -1 reaches an implementation ------------------------------------------------------


@pytest.mark.parametrize("branch", ["eager", pytest.param("no-sync", marks=pytest.mark.skipif(
    not INTERPRETED, reason="device mode on the CPU needs TRITON_INTERPRET=1"))])  # fmt: skip
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_no_minus_one_reaches_an_implementation(implementation, branch, monkeypatch, fake_compiling):
    model = tiny_model("gpt_oss")  # biases: a -1 would also read a wrong bias row
    model.set_experts_implementation(implementation)
    tokens = prompt(32)
    try:
        reference = logits_of(model, tokens)
    except Exception as error:  # e.g. deepgemm, sonicmoe: kernels for a GPU
        pytest.skip(f"{implementation} does not run here uncached ({type(error).__name__})")
    # 2 slots for 32 tokens x top-2: every call runs in passes, each marking the others -1
    mode = "device" if branch == "no-sync" else "host"
    calls: list = []
    _spy_on_implementation(monkeypatch, implementation, calls)  # before enabling: it wraps the spy
    handle = enable_expert_cache(model, cache_size=TINY.top_k, budget="per-layer", mode=mode)
    fake_compiling["on"] = branch == "no-sync"
    cached = logits_of(model, tokens)
    fake_compiling["on"] = False
    _close(cached, reference)
    assert len(calls) > TINY.num_moe_layers  # passes ran
    assert all(0 <= low and high < width for low, high, width in calls)  # width: num_experts (+1 eager)
    handle.disable()


# -- 3. disable(to=...), all or nothing ------------------------------------------------------


def test_disable_to_cpu_and_bad_targets():
    model = tiny_model("mixtral")
    snapshot = _expert_weights(model)
    handle = enable_expert_cache(model, cache_size=4)
    with pytest.raises(ValueError, match="'original' or 'cpu'"):
        handle.disable(to="cuda")
    assert handle.enabled and model.config._experts_implementation == IMPLEMENTATION_NAME
    handle.disable(to="cpu")
    assert not handle.enabled and model.config._experts_implementation != IMPLEMENTATION_NAME
    assert all(p.device.type == "cpu" for name, p in model.named_parameters() if name in snapshot)
    assert _same_weights(model, snapshot)
    with pytest.raises(ValueError, match="'original' or 'cpu'"):
        handle.disable(to="gpu")  # a disabled handle still refuses a bad setting


@pytest.mark.parametrize(
    "failure, raised, message",
    [
        (torch.OutOfMemoryError("CUDA out of memory"), RuntimeError, r"nothing changed.*disable\(to='cpu'\)"),
        (OSError("injected"), OSError, "injected"),  # anything else propagates as it is
    ],
)
def test_a_failed_disable_changes_nothing(failure, raised, message, monkeypatch):
    model = tiny_model("qwen3_moe")
    snapshot = _expert_weights(model)
    tokens = prompt(12)
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4, budget="per-layer")
    logits_of(model, tokens)
    calls_before = handle.stats.total.calls
    real = handle_module.restored_weights
    built: list = []

    def fails_on_the_second_block(item, device=None, targets=None):
        if built:
            raise failure
        built.append(real(item, device, targets))
        return built[-1]

    monkeypatch.setattr(handle_module, "restored_weights", fails_on_the_second_block)
    with pytest.raises(raised, match=message):
        handle.disable()
    assert len(built) == 1  # the failure came mid-restore
    assert handle.enabled and model.config._experts_implementation == IMPLEMENTATION_NAME
    assert all(p.numel() == 0 for name, p in model.named_parameters() if name in snapshot)
    _close(logits_of(model, tokens), reference)  # still served, by the cache
    assert handle.stats.total.calls == calls_before + TINY.num_moe_layers
    monkeypatch.undo()
    handle.disable()
    assert _same_weights(model, snapshot)


@pytest.mark.gpu
def test_disable_refuses_when_the_gpu_cannot_hold_the_experts(monkeypatch):
    model = tiny_model("qwen3_moe", device="cuda")
    snapshot = _expert_weights(model)
    handle = enable_expert_cache(model, cache_size=4)
    real = torch.cuda.mem_get_info
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, real(device)[1]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    with pytest.raises(RuntimeError, match=r"nothing changed.*disable\(to='cpu'\)"):
        handle.disable()
    assert handle.enabled and all(p.numel() == 0 for name, p in model.named_parameters() if name in snapshot)
    handle.disable(to="cpu")  # host memory is not measured: it goes through
    experts = {name: p for name, p in model.named_parameters() if name in snapshot}
    assert all(p.device.type == "cpu" for p in experts.values())
    assert all(torch.equal(experts[name].detach(), value.cpu()) for name, value in snapshot.items())


# -- 4. the device flag ----------------------------------------------------------------------


def _engine_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="engine")
    add_cache_arguments(parser)
    return parser


def test_the_device_flag_and_its_default(monkeypatch):
    chosen = _engine_parser().parse_args(["--moe-expert-cache-size", "2", "--moe-expert-cache-device", "cpu"])
    assert cache_config_from_args(chosen).device == "cpu"
    default = _engine_parser().parse_args(["--moe-expert-cache-size", "2"])
    expected = "cuda" if torch.cuda.is_available() else None  # None: where the weights are
    assert cache_config_from_args(default).device == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cache_config_from_args(default).device == "cuda"


@pytest.mark.parametrize("text", ["tpu", "cuda:x", "", "cpu:1", "cuda:99"])
def test_a_bad_device_flag_is_one_line_and_exit_2(text, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path), "--moe-expert-cache-size", "4", "--moe-expert-cache-device", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--moe-expert-cache-device" in err and "Traceback" not in err


@pytest.mark.gpu
def test_the_two_engine_lines_put_a_host_model_on_gpu_slots():
    resident = tiny_model("qwen3_moe", dtype=torch.bfloat16, device="cuda")
    resident.set_experts_implementation("batched_mm")
    tokens = prompt(12, device="cuda")
    reference = logits_of(resident, tokens)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)  # same seed: same weights, on the host
    model.set_experts_implementation("batched_mm")
    args = _engine_parser().parse_args(["--moe-expert-cache-size", "4"])
    handle = enable_expert_cache(model, cache_config_from_args(args))
    provider = handle.provider(handle.layers[0])
    assert provider.device.type == "cuda" and provider.store.pinned
    model.to("cuda")
    assert torch.equal(logits_of(model, tokens), reference)
    handle.disable(to="cpu")
    assert all(p.device.type == "cpu" for name, p in model.named_parameters() if ".experts." in name)


# -- 5. set_experts_implementation and dtype changes while served ----------------------------


@pytest.mark.parametrize("switch_to", ["batched_mm", "eager"])
def test_set_experts_implementation_while_served_is_followed(switch_to, monkeypatch):
    model = tiny_model("olmoe")
    model.set_experts_implementation("grouped_mm")
    snapshot = _expert_weights(model)
    tokens = prompt(12)
    reference = logits_of(model, tokens)
    handle = enable_expert_cache(model, cache_size=4)
    calls: list = []
    _spy_on_implementation(monkeypatch, switch_to, calls)
    model.set_experts_implementation(switch_to)  # was: a bare IndexError at the next forward
    _close(logits_of(model, tokens), reference)
    # the new implementation ran, on the slots: once a pass (a layer's call may need two of
    # its share of the global pool)
    assert len(calls) >= TINY.num_moe_layers
    assert handle.stats.total.calls == TINY.num_moe_layers  # and the cache served every layer
    handle.disable()
    assert model.config._experts_implementation == switch_to  # the user's choice stays
    assert _same_weights(model, snapshot)


def test_a_dtype_change_while_served_is_refused_and_disable_follows_it():
    model = tiny_model("qwen2_moe")
    snapshot = _expert_weights(model)
    tokens = prompt(12)
    expected = logits_of(copy.deepcopy(model).to(torch.bfloat16), tokens)
    handle = enable_expert_cache(model, cache_size=4)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"float32 to torch.bfloat16.*disable\(\)"):
        logits_of(model, tokens)
    assert handle.enabled and handle.stats.total.calls == 0  # refused before the cache ran
    handle.disable()
    assert _same_weights(model, snapshot, dtype=torch.bfloat16)  # in the model's dtype now
    assert torch.equal(logits_of(model, tokens), expected)
