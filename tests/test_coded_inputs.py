"""Misuse of the exponent-coded stores' public pieces: each bad input is refused with a message
naming the argument, before anything changes.

- the encoder: ``progress`` of the wrong type, a meta tensor, experts without values, an
  ``analysis`` or ``out`` that is not one, and a tensor other than the analysed one (was a
  raw IndexError after earlier steps had written ``out``);
- the code's dataclasses: an `ExponentCode` dtype that is not a dtype, `RecordFormat` and
  `Analysis` fields that no encoder writes;
- the decoding copy's launcher: ``num_programs`` / ``num_experts`` of the wrong type or range
  (0 programs was silently the default), a source too short for ``num_experts`` records
  (read past its end), slot tensors of different slot counts (written past the smaller),
  a strided or misaligned source or scratch, arguments that are not tensors or plans;
- the manifest: every field type-checked on read (not only the plan's), sizes that
  contradict each other, and `Manifest.write` refusing what `Manifest.read` refuses.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import expertcache.exponent_blocks as exponent_blocks
from expertcache.compression import encode
from expertcache.exponent_analysis import Analysis, analyse
from expertcache.exponent_code import ExponentCode, RecordFormat
from expertcache.exponent_decode import decode_records_torch
from expertcache.exponent_records import write_records
from expertcache.kernels.copy_experts import CopyPlan
from expertcache.kernels.decode_copy import build_decode_segments, decode_copy, decode_copy_torch
from expertcache.manifest import Manifest, TensorEntry

CODE = ExponentCode(torch.bfloat16, 3, 16)


def _experts(seed: int = 1) -> torch.Tensor:
    return (torch.randn(3, 40, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16()


# -- the encoder -------------------------------------------------------------------------------


@pytest.mark.parametrize("per_step", [1 << 24, 40], ids=["one step", "an expert a step"])
def test_writing_a_tensor_that_does_not_fit_the_analysis_writes_nothing(monkeypatch, per_step):
    """Same shape, other exponents: more escapes than the analysis reserved (was an IndexError)."""
    tensor = _experts()
    analysis = analyse(tensor, CODE)
    other = tensor.clone()
    other[2] = torch.logspace(-30, 30, 40).bfloat16()  # the last step's expert: exponents far apart
    monkeypatch.setattr(exponent_blocks, "VALUES_PER_STEP", per_step)
    out = torch.full((3, analysis.format.record_bytes), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="tensor does not fit the analysis"):
        write_records(other, analysis, out)
    assert bool((out == 7).all())


def test_writing_refuses_an_analysis_or_out_that_is_not_one():
    tensor = _experts()
    analysis = analyse(tensor, CODE)
    with pytest.raises(TypeError, match="analysis must be an Analysis, got str"):
        write_records(tensor, "analysis", torch.empty(3, analysis.format.record_bytes, dtype=torch.uint8))
    with pytest.raises(TypeError, match="out must be a tensor, got list"):
        write_records(tensor, analysis, [0] * 3)


def test_progress_must_be_a_label():
    with pytest.raises(TypeError, match="progress must be a str or None, got bool"):
        analyse(_experts(), CODE, progress=True)


def test_experts_on_the_meta_device_are_refused():
    with pytest.raises(ValueError, match="unsupported device meta"):
        analyse(torch.empty(3, 40, dtype=torch.bfloat16, device="meta"), CODE)


def test_experts_without_values_encode_to_empty_records():
    fmt, records = encode(torch.zeros(3, 0, dtype=torch.bfloat16), CODE)
    assert fmt.record_bytes == 0 and records.shape == (3, 0)
    decoded = decode_records_torch(records, fmt)  # and decode back (it crashed in a reshape)
    assert decoded.shape == (3, 0) and decoded.dtype == torch.bfloat16


def test_the_reference_decoder_refuses_a_format_that_is_not_one():
    fmt, records = encode(_experts(), CODE)
    with pytest.raises(TypeError, match="fmt must be a RecordFormat, got dict"):
        decode_records_torch(records, dataclasses.asdict(fmt))


# -- the code's dataclasses --------------------------------------------------------------------


def test_the_code_dtype_must_be_a_dtype():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got list"):
        ExponentCode([torch.bfloat16])


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (("code", 40, 0), TypeError, "code must be an ExponentCode, got str"),
        ((CODE, 40.0, 0), TypeError, "values must be an int, got float"),
        ((CODE, True, 0), TypeError, "values must be an int, got bool"),
        ((CODE, -5, 0), ValueError, "values must be at least 0, got -5"),
        ((CODE, 40, 8), ValueError, "capacity must be a multiple of 16 from 0 to 16, got 8"),
        ((CODE, 40, 32), ValueError, "capacity must be a multiple of 16 from 0 to 16, got 32"),
        ((CODE, 40, 0, 4), ValueError, "spill must be a multiple of 8 from 0 to 16, got 4"),
        ((ExponentCode(torch.bfloat16, 3, 16, second_bits=0), 40, 0, 8), ValueError, "spill must be 0"),
    ],
)
def test_record_formats_no_encoder_writes_are_refused(fields, error, message):
    with pytest.raises(error, match=message):
        RecordFormat(*fields)


def test_an_analysis_whose_codebooks_do_not_fit_its_format_is_refused():
    good = analyse(_experts(), CODE)
    with pytest.raises(TypeError, match="format must be a RecordFormat"):
        Analysis("format", good.codebooks)
    with pytest.raises(ValueError, match=r"codebooks must be int64 \[E, 3, 14\]"):
        Analysis(good.format, good.codebooks[:, :2])
    with pytest.raises(ValueError, match=r"codebooks must hold exponents from 0 to 255"):
        Analysis(good.format, good.codebooks + 256)


# -- the decoding copy -------------------------------------------------------------------------


def _launch():
    tensor = _experts()
    fmt, records = encode(tensor, CODE)
    plan = CopyPlan.of(torch.tensor([3, 0, 0, 0, 0, 1, 1, 0, 0, 2, 2, 0, 0], dtype=torch.int32))
    return tensor, records.reshape(-1).clone(), plan, build_decode_segments((0,), (fmt,))


def _slots(count: int = 4, values: int = 40) -> list[torch.Tensor]:
    return [torch.full((count, values), -7.0, dtype=torch.bfloat16)]


@pytest.mark.parametrize(
    "settings, error, message",
    [
        ({"num_programs": 0}, ValueError, "num_programs must be at least 1, got 0"),  # was the default
        ({"num_programs": True}, TypeError, "num_programs must be an int or None, got bool"),
        ({"num_programs": 2.0}, TypeError, "num_programs must be an int or None, got float"),
        ({"num_experts": 3.0}, TypeError, "num_experts must be an int, got float"),
        ({"num_experts": -1}, ValueError, "num_experts must be at least 0, got -1"),
        ({"num_experts": 5}, ValueError, "source holds .* bytes; 5 experts of the segments need"),  # read past it
    ],
)
def test_decode_copy_refuses_bad_settings_and_writes_nothing(settings, error, message):
    _, source, plan, segments = _launch()
    slots = _slots()
    with pytest.raises(error, match=message):
        decode_copy(source, slots, plan, segments, **{"num_experts": 3, **settings})
    assert bool((slots[0] == -7.0).all())


def test_decode_copy_refuses_slot_tensors_of_different_slot_counts():
    """Slot ids were checked against the first tensor only: a smaller second one was written past."""
    first, _ = encode(_experts(1), CODE)
    second, _ = encode(_experts(2)[:, :20], CODE)
    segments = build_decode_segments((0, 1024), (first, second))
    slots = [torch.zeros(4, 40, dtype=torch.bfloat16), torch.zeros(2, 20, dtype=torch.bfloat16)]
    plan, source = _launch()[2], torch.zeros(2048, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"slot tensors must all hold 4 slots, got \[4, 2\]"):
        decode_copy(source, slots, plan, segments, num_experts=3)
    with pytest.raises(ValueError, match="slot tensors must hold at least one slot"):
        decode_copy(source, [t[:0] for t in slots], plan, segments, num_experts=3)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: torch.cat([s, s])[::2], "source must be a contiguous flat uint8 buffer on a 16-byte boundary"),
        (lambda s: torch.cat([torch.zeros(4, dtype=torch.uint8), s])[4:], "on a 16-byte boundary"),
        (lambda s: torch.cat([s, torch.zeros(3, dtype=torch.uint8)]), "a multiple of 16 bytes"),
    ],
    ids=["strided", "misaligned", "ragged size"],
)
def test_decode_copy_refuses_a_source_the_kernel_cannot_read_in_words(change, message):
    _, source, plan, segments = _launch()
    with pytest.raises(ValueError, match=message):
        decode_copy(change(source), _slots(), plan, segments, num_experts=3)


def test_decode_copy_refuses_a_strided_scratch():
    """The kernel writes the scratch from its first byte on: a strided view was written past."""
    _, source, plan, segments = _launch()
    scratch = torch.zeros(2 * segments.stage_words * 4 * 2, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="scratch must be a contiguous uint8 buffer"):
        decode_copy(source, _slots(), plan, segments, num_experts=3, scratch=scratch)


def test_decode_copy_refuses_arguments_that_are_not_tensors_or_plans():
    tensor, source, plan, segments = _launch()
    with pytest.raises(TypeError, match="source must be a tensor, got bytes"):
        decode_copy(bytes(16), _slots(), plan, segments, num_experts=3)
    with pytest.raises(TypeError, match="slots must be a list of tensors, got int"):
        decode_copy(source, [1], plan, segments, num_experts=3)
    with pytest.raises(TypeError, match="plan must be a CopyPlan, got str"):
        decode_copy(source, _slots(), "plan", segments, num_experts=3)
    with pytest.raises(TypeError, match="segments must be DecodeSegments, got str"):
        decode_copy(source, _slots(), plan, "segments", num_experts=3)
    with pytest.raises(ValueError, match=r"segments must hold one offset and first chunk per format"):
        decode_copy(source, _slots(), plan, segments._replace(offsets=()), num_experts=3)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the control launches: a GPU, or interpreted
    slots = [slot.to(device) for slot in _slots()]
    plan = CopyPlan.of(torch.tensor([3, 0, 0, 0, 0, 1, 1, 0, 0, 2, 2, 0, 0], dtype=torch.int32, device=device))
    decode_copy(source.to(device), slots, plan, segments, num_experts=3)  # control
    assert torch.equal(slots[0][:3].cpu(), tensor)


# -- the manifest ------------------------------------------------------------------------------


def _manifest() -> Manifest:
    entry = TensorEntry("w1", (4, 2), "float32", 32)
    return Manifest((entry,), layers=1, experts=4, expert_bytes=32, num_slots=2, pool_gpu_bytes=64,
                    host_bytes=128, pinned_host_bytes=0, full_residency_gpu_bytes=128, gpu_bytes_freed=64,
                    device="cpu")  # fmt: skip


_ENTRY = "'tensors' entry 0"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(manifest_version=2.0), "not an expertcache manifest"),
        (lambda d: d["tensors"][0].update(shape="ab"), f"{_ENTRY}: 'shape' must be a list of integers >= 0"),
        (lambda d: d["tensors"][0].update(shape=[-1, 2]), f"{_ENTRY}: 'shape' must be a list of integers >= 0"),
        (lambda d: d["tensors"][0].update(bytes="32"), f"{_ENTRY}: 'bytes' must be an integer >= 0"),
        (lambda d: d["tensors"][0].update(name=5), f"{_ENTRY}: 'name' must be a string"),
        (lambda d: d["tensors"][0].update(dtype=None), f"{_ENTRY}: 'dtype' must be a string"),
        (lambda d: d["tensors"][0].update(extra=1), f"{_ENTRY} must have the keys bytes, dtype, name, shape"),
        (lambda d: d.update(num_slots=-1), "'num_slots' must be an integer >= 0, got -1"),
        (lambda d: d.update(host_bytes="128"), "'host_bytes' must be an integer >= 0, got '128'"),
        (lambda d: d.update(gpu_bytes_freed=64.0), "'gpu_bytes_freed' must be an integer, got 64.0"),
        (lambda d: d.update(device=0), "'device' must be a string, got 0"),
        (lambda d: d.update(pinned_host_bytes=129), r"'pinned_host_bytes' \(129\) must be at most 'host_bytes'"),
        (lambda d: d.update(gpu_bytes_freed=7), r"'gpu_bytes_freed' \(7\) must be 'full_residency_gpu_bytes'"),
        (lambda d: d["tensors"][0].update(bytes=31), r"'expert_bytes' \(32\) must be the sum of the tensors' bytes"),
    ],
)  # fmt: skip
def test_a_manifest_with_a_malformed_field_is_refused_naming_it(tmp_path, change, message):
    path = tmp_path / "manifest.json"
    _manifest().write(path)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"manifest.json: {message}"):
        Manifest.read(path)


def test_writing_a_manifest_that_reading_would_refuse_leaves_the_file(tmp_path):
    path = tmp_path / "manifest.json"
    _manifest().write(path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="'num_slots' must be an integer >= 0, got -2"):
        dataclasses.replace(_manifest(), num_slots=-2).write(path)
    assert path.read_bytes() == before and Manifest.read(path) == _manifest()


def test_the_reference_decode_copy_refuses_a_strided_slot_tensor():
    """It wrote into a copy (its reshape of a strided tensor), leaving the slot as it was."""
    _, source, plan, segments = _launch()
    strided = torch.full((4, 80), -7.0, dtype=torch.bfloat16)[:, ::2]
    with pytest.raises(ValueError, match="slot tensors must be contiguous"):
        decode_copy_torch(source, [strided], plan, segments, num_experts=3)
    assert bool((strided == -7.0).all())
