"""The whole-layer streaming baseline (`benchmarks/layer_streaming.py`) computes what the
all-resident stack computes: on the CPU (the ring's buffer logic, plain copies; eagerly on
a GPU machine, with side-stream copies) and on a GPU with a whole step captured in a CUDA
graph and replayed. Both stacks run `DecodeStack`'s default apply."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import devices
from helpers import random_topk, random_weights

from expertcache import ExpertWeightProvider, FullGPUProvider
from expertcache.decode_stack import DecodeStack, GraphedDecodeStep
from expertcache.layout import layout_from_weights
from expertcache.store import CPUBackingStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer_streaming import StreamingLayers  # noqa: E402

E, H, INTER, K = 8, 32, 16, 2


def layer_weights(num_layers: int, *, experts=E, hidden=H, inter=INTER, device="cpu", seed=0) -> list[dict]:
    """Different random weights per layer, so a layer served from the wrong buffer shows."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {name: t.to(device) for name, t in random_weights(experts, hidden, inter, generator=gen).items()}
        for _ in range(num_layers)
    ]


def stores_of(weights: list[dict], *, pin: bool) -> list[CPUBackingStore]:
    _, layout = layout_from_weights(weights[0])
    return [CPUBackingStore(layout, {n: t.cpu() for n, t in w.items()}, pin=pin) for w in weights]


def routing_steps(steps: int, num_layers: int, tokens: int, *, experts=E, device="cpu", seed=1) -> torch.Tensor:
    """``[steps, L, T, K]`` fresh top-k ids every step and layer."""
    gen = torch.Generator().manual_seed(seed)
    ids = [random_topk(tokens, K, experts, generator=gen) for _ in range(steps * num_layers)]
    return torch.stack(ids).view(steps, num_layers, tokens, K).to(device)


@pytest.mark.parametrize(
    ("num_layers", "depth"),
    [
        (3, 1),
        (3, 2),  # depth = L - 1: every layer but the computing one in flight
        (4, 1),  # L % (depth + 1) == 0: the ring wraps exactly at the step's end
        (4, 2),  # the step ends with layers 0 .. depth-1 in the wrong buffers for the next step
        (5, 1),
        (5, 2),
    ],
)
@pytest.mark.parametrize("device", devices())
def test_streaming_equals_resident_eagerly(num_layers, depth, device):
    weights = layer_weights(num_layers, device=device)
    ring = StreamingLayers(stores_of(weights, pin=device == "cuda"), depth, device=device)
    assert len(ring.buffers) == depth + 1
    streamed = DecodeStack(ring.providers, H, E, dtype=torch.float32, device=device)
    resident = DecodeStack([FullGPUProvider(w) for w in weights], H, E, dtype=torch.float32, device=device)
    routing = routing_steps(4, num_layers, tokens=3, device=device)
    hidden = torch.randn(4, 3, H, generator=torch.Generator().manual_seed(2)).to(device)
    for step in range(4):  # several steps: each must start from layer 0's weights again
        assert torch.equal(streamed.step(hidden[step], routing[step]), resident.step(hidden[step], routing[step]))


def test_each_layer_reads_its_own_weights_from_a_fixed_address():
    weights = layer_weights(4)
    ring = StreamingLayers(stores_of(weights, pin=False), 2, device="cpu")
    ids = torch.tensor([[0, 1]])
    addresses = {}
    for _ in range(2):
        for layer, provider in enumerate(ring.providers):
            result = provider.prepare(ids)
            assert torch.equal(result.topk_ids, ids)  # ids index the [E, ...] buffer as they are
            for name in ("w1", "w2"):
                assert result.w1.shape == (E, 2 * INTER, H) and getattr(result, name).is_contiguous()
                assert torch.equal(getattr(result, name), weights[layer][name])
            addresses.setdefault(layer, result.w1.data_ptr())
            assert result.w1.data_ptr() == addresses[layer] == ring.buffers[layer % 3]["w1"].data_ptr()
    assert ring.bytes_per_step == 4 * ring.stores[0].nbytes


def test_layers_out_of_order_and_bad_depths_raise():
    stores = stores_of(layer_weights(3), pin=False)
    for depth in (0, 3):  # no prefetch; more layers in flight than there are
        with pytest.raises(ValueError, match="depth"):
            StreamingLayers(stores, depth, device="cpu")
    ring = StreamingLayers(stores, 1, device="cpu")
    ids = torch.tensor([[0, 1]])
    ring.providers[0].prepare(ids)
    with pytest.raises(RuntimeError, match="expected layer 1"):
        ring.providers[2].prepare(ids)
    ring.providers[0].prepare(ids)  # layer 0 always starts a fresh step
    ring.providers[1].prepare(ids)


class Delayed(ExpertWeightProvider):
    """``inner``'s weights, then a GPU spin on the current stream before the layer reads them.

    The layer's compute runs late: a prefetch that did not wait for the compute that last
    read its buffer would overwrite the buffer before the delayed compute reads it."""

    def __init__(self, inner: ExpertWeightProvider, delay_cycles: int) -> None:
        self.inner, self.delay_cycles = inner, delay_cycles

    def prepare(self, topk_ids):
        result = self.inner.prepare(topk_ids)
        torch.cuda._sleep(self.delay_cycles)
        return result


@pytest.mark.gpu
@pytest.mark.parametrize("delay_cycles", [0, 10_000_000])  # 0: copies are the slow part; ~5 ms: compute is
@pytest.mark.parametrize(("num_layers", "depth"), [(4, 1), (5, 2)])
def test_graphed_streaming_replays_equal_eager_resident(num_layers, depth, delay_cycles):
    # ~1.5 MB per expert, ~50 MB per layer: each layer's copy takes ~1 ms, its compute microseconds
    shape = dict(experts=32, hidden=512, inter=256)
    weights = layer_weights(num_layers, device="cuda", **shape)
    ring = StreamingLayers(stores_of(weights, pin=True), depth, device="cuda")
    providers = [Delayed(p, delay_cycles) for p in ring.providers]
    streamed = DecodeStack(providers, shape["hidden"], shape["experts"], dtype=torch.float32, device="cuda")
    resident = DecodeStack([FullGPUProvider(w) for w in weights], shape["hidden"], shape["experts"],
                           dtype=torch.float32, device="cuda")  # fmt: skip
    steps, tokens = 6, 4
    routing = routing_steps(steps, num_layers, tokens, experts=shape["experts"], device="cuda")
    hidden = torch.randn(steps, tokens, shape["hidden"], device="cuda")
    graphed = GraphedDecodeStep(streamed, hidden[0], routing[:1])
    for step in range(steps):
        for buffer in ring.buffers:  # poison: a layer computing before its copy landed reads NaN
            buffer["w1"].fill_(float("nan"))
        out = graphed(hidden[step], routing[step]).clone()
        torch.testing.assert_close(out, resident.step(hidden[step], routing[step]), rtol=1e-5, atol=1e-5)
