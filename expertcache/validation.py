"""Input checks shared by the providers. Each raises before anything changes."""

from __future__ import annotations

import numbers
import operator

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
#: The most slots a pool can have: slot ids are int32 in the tables and kernels.
MAX_SLOTS = 2**31 - 1


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """The device to hold slots on: the current CUDA device when None and CUDA exists, else CPU.

    Raises:
        ValueError: an unparsable device, a CUDA device without CUDA, or one that does not
            exist on this machine.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    check_device_index(device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a device: {device!r} ({exc})") from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise ValueError(f"there is one CPU device; got {dev}")
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"unsupported device {dev}; expertcache serves CUDA devices or the CPU")
    if not torch.cuda.is_available():
        raise ValueError(f"device {dev} requested but CUDA is not available on this machine")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {dev} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def check_device_index(device: object) -> None:
    """Refuse a device string whose index torch would wrap: it keeps an 8-bit index, so
    ``torch.device("cuda:256")`` is ``cuda:0`` and ``"cuda:1000"`` is ``cuda:-24``.

    Raises:
        ValueError: ``device`` is a str that torch reads as another device.
    """
    if not isinstance(device, str):
        return
    try:
        parsed = str(torch.device(device))
    except (RuntimeError, ValueError):
        return  # not a device at all: the caller's own check says so
    if parsed != device:
        raise ValueError(f"device {device!r}: no such device index (torch would read it as {parsed!r})")


def check_mode_device(device: torch.device) -> None:
    """Device mode (and the copy kernel) run Triton kernels: a GPU, or the interpreter on a CPU.

    Raises:
        ValueError: ``device`` is the CPU and Triton is not interpreting.
    """
    from expertcache.kernels._launch import interpreted

    if device.type == "cpu" and not interpreted():
        raise ValueError(
            "mode 'device' runs its admission as Triton kernels on a CUDA GPU, not on the CPU; use mode "
            "'host' (it works anywhere), or set TRITON_INTERPRET=1 before importing expertcache to interpret "
            "the kernels on the CPU (slowly; the tests do)"
        )


def check_flag(name: str, value: object) -> bool:
    """A yes/no setting (``passes(..., overlap=)``, ``landing=``, an apply's ``fp32_out=``)
    is a bool (a truthy string or tensor is not a promise)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_overlap(overlap: object) -> bool:
    """``passes(..., overlap=)`` is a bool."""
    return check_flag("overlap", overlap)


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None, expected: str = "an int"
) -> int:
    """``value`` as a Python int: any integer (``int``, ``np.int64``, any `numbers.Integral`),
    never a bool (``True`` is not a count) and never a float, even a whole one.

    Raises:
        TypeError: ``value`` is not an integer (the message says ``name`` must be ``expected``).
        ValueError: ``value`` is below ``minimum`` or above ``maximum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r:.40}")
    number = operator.index(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum:,}, got {number:,}")
    return number


def check_pin_budget_bytes(budget: object) -> int | None:
    """``pin_budget_bytes``: None (no limit) or an int >= 0 (0 refuses every store), as an int.

    Raises:
        TypeError: not an integer or None. ValueError: negative.
    """
    if budget is None:
        return None
    number = check_int("pin_budget_bytes", budget, expected="an int (bytes) or None")
    if number < 0:
        raise ValueError(f"pin_budget_bytes must be >= 0 (bytes; None for no limit), got {number}")
    return number


def is_dense(tensor: torch.Tensor) -> bool:
    """A plain strided tensor: not sparse (COO, CSR, ...), not nested. Index checks, kernels
    and ``.numpy()`` read only these."""
    return tensor.layout == torch.strided and not tensor.is_nested


def layout_name(tensor: torch.Tensor) -> str:
    """What kind of tensor it is, for errors: ``"nested"``, ``"sparse_coo"``, ``"strided"``, ..."""
    return "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")


def check_topk_ids(topk_ids: object, device: torch.device, *, name: str = "topk_ids") -> torch.Tensor:
    """Check ``topk_ids`` is a dense int32/int64 ``[T, K]`` tensor on ``device`` (metadata only);
    errors call it ``name``."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(topk_ids).__name__}")
    if not is_dense(topk_ids):
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {layout_name(topk_ids)} tensor")
    if topk_ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64 expert ids, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.device != device:
        raise ValueError(f"{name} is on {topk_ids.device}, but the expert weights are on {device}")
    return topk_ids


def check_ids_in_range(topk_ids: torch.Tensor, num_ids: int, *, name: str = "topk_ids") -> None:
    """Check every id of a CPU ``topk_ids`` is in ``[0, num_ids)`` (a GPU tensor's values would
    need a sync to read: device paths map such ids to -1 instead).

    Raises:
        IndexError: an id outside ``[0, num_ids)``, named in the message (`check_id_bounds`).
    """
    if topk_ids.numel() == 0:
        return
    low, high = (int(bound) for bound in torch.aminmax(topk_ids))
    check_id_bounds(low, high, num_ids, name=name)


def check_id_bounds(low: int, high: int, num_ids: int, *, name: str = "topk_ids", skip_id: bool = False) -> None:
    """The expert-id range rule, on the smallest and largest id of a non-empty call, already
    read to the host (each caller reads them its own way, in the syncs it already has).

    Args:
        low, high: the call's smallest and largest id.
        num_ids: ids must be below it (``E_global``).
        skip_id: -1 is allowed too (it means "skip this choice"), and the message says so.

    Raises:
        IndexError: ``low`` below 0 (below -1 with ``skip_id``) or ``high >= num_ids``; the
            message names the smallest id when it is too small, else the largest.
    """
    first = -1 if skip_id else 0
    if low < first or high >= num_ids:
        skip = " (-1 = skip)" if skip_id else ""
        raise IndexError(f"expert id {low if low < first else high} in {name} is outside [{first}, {num_ids}){skip}")


def check_expert_map(expert_map: object, num_local_experts: int, *, name: str = "expert_map") -> torch.Tensor:
    """Validate an EP ``expert_map`` (``[E_global]``: local index, or -1) against the weights.

    Every local index ``0 .. num_local_experts-1`` must appear exactly once. ``name``: the
    argument's name in the errors (``global_to_local`` for `SlotPool.attach`).

    Returns:
        The map as a CPU int32 tensor.
    """
    if not isinstance(expert_map, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(expert_map).__name__}")
    if not is_dense(expert_map):
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {expert_map.layout}")
    if expert_map.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {expert_map.dtype}")
    if expert_map.dim() != 1:
        raise ValueError(f"{name} must be 1-D [E_global], got shape {tuple(expert_map.shape)}")
    values = expert_map.detach().to("cpu", torch.int64)
    if bool((values < -1).any()):
        raise ValueError(f"{name} entries must be a local expert index or -1")
    local = values[values >= 0]
    expected = torch.arange(num_local_experts)
    if local.numel() != num_local_experts or not torch.equal(local.sort().values, expected):
        raise ValueError(
            f"{name}'s local indices must be 0..{num_local_experts - 1}, each exactly once, "
            f"to match the {num_local_experts} experts in weights; got {local.tolist()[:16]}"
            + (" ..." if local.numel() > 16 else "")
        )
    return values.to(torch.int32)
