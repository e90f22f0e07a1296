"""What a `CPUBackingStore` checks of its coding settings before anything is allocated or
coded: a compression name that applies to the layout, and coding settings that would
change something."""

from __future__ import annotations

from expertcache.compression import COMPRESSIONS
from expertcache.exponent_code import FLOAT16_FIELDS
from expertcache.layout import ExpertLayout
from expertcache.validation import check_flag


def check_compression(compression: object, layout: ExpertLayout) -> None:
    """Raise ValueError unless ``compression`` is None or a name that applies to ``layout``."""
    if compression is None:
        return
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None or one of {COMPRESSIONS}, got {compression!r}")
    dtypes = {spec.name: spec.dtype for spec in layout.specs}
    wrong = {name: str(dtypes[name]) for name in ("w1", "w2") if dtypes[name] not in FLOAT16_FIELDS}
    if wrong:
        raise ValueError(
            f"compression={compression!r} codes bfloat16 or float16 experts losslessly; "
            f"the expert matrices are {wrong}: store them raw (compression=None)"
        )


def check_coding_settings(compression: str | None, encode_device: object, progress: object) -> None:
    """Refuse a progress that is not a bool or None, and coding settings that would change
    nothing: an ``encode_device`` or ``progress=True`` without compression."""
    if progress is not None:
        check_flag("progress", progress)
    given = "encode_device" if encode_device is not None else "progress=True" if progress else None
    if compression is None and given:
        raise ValueError(f"{given} applies with compression='exponent'; without compression nothing is coded")
