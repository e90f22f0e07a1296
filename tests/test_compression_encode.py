"""Where the exponent code is computed does not change a byte: the encoder on a given device
(``"cpu"``, and ``"cuda"`` on a GPU machine), in steps of any size, and the store coding on
its `encoding_device` (falling back to the CPU when the GPU is full) write the records the
plain CPU path writes."""

from __future__ import annotations

import pytest
import torch
from test_compression import bits, coded_weights, with_specials

import expertcache.exponent_blocks as exponent_blocks
import expertcache.store as store_module
from expertcache import SlotPool
from expertcache.compression import encode
from expertcache.exponent_code import ExponentCode
from expertcache.exponent_decode import decode_records_torch
from expertcache.store import CPUBackingStore, encoding_device

ENCODE_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def experts(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """7 experts of 37 x 29 values (ragged blocks of 64) at two scales, with specials."""
    gen = torch.Generator().manual_seed(11)
    tensor = torch.randn(7, 37, 29, generator=gen) * torch.tensor([0.002, 0.05]).repeat_interleave(29)[:29]
    return with_specials(tensor.to(dtype), 3)


@pytest.mark.parametrize("device", ENCODE_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_step", [1 << 24, 37 * 29 * 2], ids=["one step", "two experts a step"])
def test_encoding_on_a_device_writes_the_cpu_bytes(monkeypatch, device, dtype, per_step):
    tensor, code = experts(dtype), ExponentCode(dtype, 3, 64)
    fmt, expected = encode(tensor, code)  # the CPU path, one step
    monkeypatch.setattr(exponent_blocks, "VALUES_PER_STEP", per_step)
    for source in (tensor, tensor.to(device)):  # CPU experts moved a step at a time; experts already there
        got_fmt, records = encode(source, code, device=device)
        assert got_fmt == fmt and records.device.type == "cpu"
        assert torch.equal(records, expected)
    assert torch.equal(bits(decode_records_torch(expected, fmt)), bits(tensor.reshape(7, -1)))


def test_steps_of_one_expert_write_the_bytes_of_one_step(monkeypatch):
    """The default block (8192) over a ragged second block, one expert per step vs all at once."""
    tensor = with_specials((torch.randn(5, 9000, generator=torch.Generator().manual_seed(2)) * 0.02), 1)
    code = ExponentCode(torch.bfloat16)
    _, whole = encode(tensor.to(torch.bfloat16), code)
    monkeypatch.setattr(exponent_blocks, "VALUES_PER_STEP", 1)
    _, stepped = encode(tensor.to(torch.bfloat16), code)
    assert torch.equal(whole, stepped)


@pytest.mark.parametrize("device", ENCODE_DEVICES)
def test_a_store_coded_on_a_device_holds_the_cpu_bytes(device):
    weights = coded_weights()
    layout = SlotPool.for_weights(weights, 1).layout
    reference = CPUBackingStore(layout, weights, pin=False, compression="exponent", encode_device="cpu")
    for source in (weights, {name: w.to(device) for name, w in weights.items()}):
        coded = CPUBackingStore(layout, source, pin=False, compression="exponent", encode_device=device, progress=True)
        assert set(coded.formats) == {"w1", "w2", "bias"} and coded.formats == reference.formats
        assert torch.equal(coded.buffer, reference.buffer)  # records, raw names and padding
    for name, tensor in weights.items():
        assert torch.equal(bits(reference.tensors[name]), bits(tensor))


def test_a_full_gpu_codes_on_the_cpu_instead(monkeypatch):
    """An out-of-memory error on the encoding device: a warning, then the same bytes from the CPU."""
    real = store_module.analyse
    devices_asked = []

    def analyse(tensor, code, *, progress=None, device=None):
        devices_asked.append(torch.device(device).type)
        if torch.device(device).type != "cpu":
            raise torch.cuda.OutOfMemoryError("injected: out of memory")
        return real(tensor, code, progress=progress, device=device)

    monkeypatch.setattr(store_module, "analyse", analyse)
    monkeypatch.setattr(store_module, "resolve_device", torch.device)  # "cuda" taken on a CPU-only machine too
    weights = coded_weights()
    layout = SlotPool.for_weights(weights, 1).layout
    with pytest.warns(UserWarning, match="coding on the CPU"):
        coded = CPUBackingStore(layout, weights, pin=False, compression="exponent", encode_device="cuda")
    assert devices_asked[:2] == ["cuda", "cpu"] and set(devices_asked[2:]) == {"cpu"}
    monkeypatch.setattr(store_module, "analyse", real)
    reference = CPUBackingStore(layout, weights, pin=False, compression="exponent", encode_device="cpu")
    assert torch.equal(coded.buffer, reference.buffer)


def test_the_encoding_device_follows_the_experts():
    weights = {"w1": torch.zeros(2, 4, dtype=torch.bfloat16)}
    assert encoding_device(weights, "cpu") == torch.device("cpu")
    missing = torch.device("cuda", torch.cuda.device_count())  # one past the last GPU, or any without CUDA
    with pytest.raises(ValueError, match=f"device {missing}"):
        encoding_device(weights, missing)
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert encoding_device(weights) == expected


@pytest.mark.parametrize(
    "device, message",
    [("meta", "unsupported device meta"), ("cpu:1", "there is one CPU device"), ("gpu0", "not a device: .gpu0.")],
)
def test_a_store_refuses_an_encode_device_it_cannot_use_before_coding(device, message, monkeypatch):
    """Before: torch's own errors (or an AssertionError for "cuda" without CUDA) from the first copy."""
    coded = []
    monkeypatch.setattr(store_module, "analyse", lambda *args, **kwargs: coded.append(1))
    weights = coded_weights()
    layout = SlotPool.for_weights(weights, 1).layout
    with pytest.raises(ValueError, match=message):
        CPUBackingStore(layout, weights, pin=False, compression="exponent", encode_device=device)
    assert coded == []
