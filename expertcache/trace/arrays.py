"""Array conversions for `RoutingTrace` that never wrap, truncate or guess.

Expert ids are stored in the narrowest integer dtype that holds every value (int16 while
the largest id fits, else int32); index arrays are int64. Floats and bools are refused
rather than cast: ``2.7`` is not an expert id and ``True`` is not a token index.
"""

from __future__ import annotations

import numpy as np

#: Ids must fit int32, so a trace has at most this many experts per layer.
MAX_EXPERTS = int(np.iinfo(np.int32).max)
_INT16_MAX = int(np.iinfo(np.int16).max)
_INT64_MAX = int(np.iinfo(np.int64).max)


def whole_number(name: str, value: object, *, minimum: int, maximum: int) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (bools and floats refused).

    Raises:
        TypeError: not an int. ValueError: out of range.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= int(value) <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return int(value)


def integer_array(name: str, values: object) -> np.ndarray:
    """``values`` as a numpy array of a signed or unsigned integer dtype, unchanged.

    An empty sequence of any numeric dtype counts as integer (``np.asarray([])`` is float).

    Raises:
        TypeError: floats, bools, strings, objects or ints beyond int64.
    """
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError) as error:
        raise ValueError(f"{name} is not a rectangular array of integers ({error})") from None
    if array.size == 0 and array.dtype.kind in "iuf":
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > _INT64_MAX:
        raise ValueError(f"{name} holds {int(array.max())}, beyond int64")
    return array


def expert_id_array(values: object, num_experts: int) -> np.ndarray:
    """``[N, L, K]`` expert ids in ``[-1, num_experts)``, as int16 if they fit, else int32.

    Raises:
        TypeError: not integers. ValueError: not 3-D, or an id out of range.
    """
    ids = integer_array("expert_ids", values)
    if ids.ndim != 3:
        raise ValueError(f"expert_ids must be [N, L, K], got shape {ids.shape}")
    smallest = int(ids.min()) if ids.size else -1
    largest = int(ids.max()) if ids.size else -1
    if smallest < -1 or largest >= num_experts:
        raise ValueError(
            f"expert_ids must be in [-1, {num_experts}) (num_experts {num_experts}), "
            f"got values from {smallest} to {largest}"
        )
    return ids.astype(np.int16 if largest <= _INT16_MAX else np.int32)


def first_repeat(expert_ids: np.ndarray) -> tuple[int, int] | None:
    """The first record of ``[..., K]`` ids that names an expert twice (-1 aside), as
    ``(record, expert)`` with records counted row-major over the leading axes; None when
    every record's ids are distinct (a router's top-k always are)."""
    if expert_ids.size == 0 or expert_ids.shape[-1] < 2:
        return None
    ordered = np.sort(expert_ids.reshape(-1, expert_ids.shape[-1]), axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if not repeated.any():
        return None
    record, position = (int(index[0]) for index in np.nonzero(repeated))
    return record, int(ordered[record, position])


def index_array(name: str, values: object) -> np.ndarray:
    """A 1-D int64 array of non-negative indices.

    Raises:
        TypeError: not integers. ValueError: not 1-D, or a negative index.
    """
    array = integer_array(name, values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    array = array.astype(np.int64)
    if array.size and int(array.min()) < 0:
        raise ValueError(f"{name} must be non-negative, got {int(array.min())}")
    return array


def strictly_increasing(array: np.ndarray) -> bool:
    return bool(np.all(np.diff(array) > 0))
