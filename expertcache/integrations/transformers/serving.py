"""Moving an expert block's weights into a `CachedWeightProvider` and back.

``serve_blocks`` copies each block's per-expert parameters into a provider (its pinned store),
then shrinks the parameters to empty placeholders, one block at a time, so the host never
holds more than one extra block; ``restore_block`` writes the store's bytes back into the
same Parameter objects (or, `restore_targets`, the new empty ones a conversion put in their
place: `current_placeholder`). Checks that need every block (pin budget, one layout for a shared
pool) run before anything is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from expertcache.cached_provider import CachedWeightProvider
from expertcache.config import ExpertCacheConfig
from expertcache.errors import PinBudgetError
from expertcache.integrations.transformers.discovery import ExpertBlock
from expertcache.layout import ExpertLayout, layout_from_weights
from expertcache.slot_pool import SlotPool
from expertcache.validation import check_pin_budget_bytes


@dataclass
class SavedParameter:
    """A parameter whose data the cache took: the object itself and its original shape/dtype."""

    parameter: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype


@dataclass
class ServedBlock:
    """An expert block, the provider serving it, and the parameters it took (by name)."""

    block: ExpertBlock
    provider: CachedWeightProvider
    saved: dict[str, SavedParameter] = field(default_factory=dict)


def current_placeholder(module: nn.Module, name: str, saved: SavedParameter, taken: set[int]) -> nn.Parameter | None:
    """The Parameter of ``module`` that stands for the served ``saved`` now, or None.

    The one taken at enabling while the module holds it; else a new *empty* Parameter the
    module holds under ``name`` (a conversion that makes new objects: ``model.to()`` under
    ``torch.__future__.set_overwrite_module_params_on_conversion(True)``, accelerate's
    ``set_module_tensor_to_device``), unless it is on the meta device or ``taken`` (the
    ``id`` of a served parameter's placeholder: a tie would serve one layer's experts as
    another's). None: deleted, or replaced by something the cache does not serve.
    """
    now = module._parameters.get(name)
    if now is saved.parameter:
        return now
    if isinstance(now, nn.Parameter) and now.numel() == 0 and now.device.type != "meta" and id(now) not in taken:
        return now
    return None


def restore_targets(item: ServedBlock, taken: set[int] | None = None) -> dict[str, nn.Parameter]:
    """Parameter name -> the Parameter `put_back` fills: the current placeholder
    (`current_placeholder`; ``taken=None``: only the Parameters taken count), else the one
    taken (the module then keeps what replaced it)."""
    targets = {}
    for name, saved in item.saved.items():
        now = None if taken is None else current_placeholder(item.block.module, name, saved, taken)
        targets[name] = now if now is not None else saved.parameter
    return targets


def serve_blocks(blocks: list[ExpertBlock], config: ExpertCacheConfig, target: torch.device, pool) -> list[ServedBlock]:
    """Copy each block's experts into its provider and free them, one block at a time (the
    host never holds more than one extra block); on any failure put back what was taken."""
    served: list[ServedBlock] = []
    try:
        for block in blocks:
            served.append(ServedBlock(block, _provider(block, config, target, pool)))
            _take_weights(served[-1])
    except BaseException:
        for item in served:
            restore_block(item)
        raise
    return served


def _weights(block: ExpertBlock) -> dict[str, torch.Tensor]:
    return {block.cache_name(name): block.module.get_parameter(name).detach() for name in block.parameter_names}


def block_layout(block: ExpertBlock) -> ExpertLayout:
    """The record layout the block's experts would have in the cache (metadata only)."""
    return layout_from_weights(_weights(block))[1]


def check_pin_budget(blocks: list[ExpertBlock], layouts: list[ExpertLayout], budget: int | None) -> None:
    """Raise `PinBudgetError` when the stores of all blocks together would exceed ``budget``
    (a ValueError for a budget that is not None or an int >= 0, `check_pin_budget_bytes`)."""
    budget = check_pin_budget_bytes(budget)
    needed = sum(layout.buffer_bytes(block.num_experts) for block, layout in zip(blocks, layouts, strict=True))
    if budget is not None and needed > budget:
        raise PinBudgetError(needed, budget)


def check_one_layout(blocks: list[ExpertBlock], layouts: list[ExpertLayout]) -> None:
    """Raise ValueError unless every block's experts have the same tensors, shapes and dtypes
    (what one pool of slots for every layer needs: the global budget)."""
    for block, layout in zip(blocks[1:], layouts[1:], strict=True):
        if layout.specs != layouts[0].specs:
            raise ValueError(
                f"budget 'global' needs every MoE layer's experts to have the same shapes and dtypes, but "
                f"those of {block.name} differ from those of {blocks[0].name}; use budget 'per-layer'"
            )


def shared_pool(blocks, layouts, config: ExpertCacheConfig, target: torch.device) -> SlotPool:
    """One pool of ``cache_size x len(blocks)`` slots for every block (the global budget)."""
    check_one_layout(blocks, layouts)
    return SlotPool(layouts[0], config.cache_size * len(blocks), device=target, policy=config.policy, mode=config.mode)


def _provider(block, config: ExpertCacheConfig, target, pool) -> CachedWeightProvider:
    if pool is None:
        return CachedWeightProvider(
            _weights(block),
            cache_size=config.cache_size,
            device=target,
            policy=config.policy,
            mode=config.mode,
            compression=config.compression,
        )
    return CachedWeightProvider(_weights(block), pool=pool, layer=block.name, compression=config.compression)


def _take_weights(item: ServedBlock) -> None:
    for name in item.block.parameter_names:
        parameter = item.block.module.get_parameter(name)
        item.saved[name] = SavedParameter(parameter, parameter.shape, parameter.dtype)
        # An empty placeholder on the same device: the memory is freed, model.to() still
        # moves it, and any read that bypasses the cache fails loudly instead of silently.
        parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)


def restored_weights(
    item: ServedBlock, device: torch.device | None = None, targets: dict[str, nn.Parameter] | None = None
) -> dict[str, torch.Tensor]:
    """The block's experts rebuilt from the store, not yet put back (this is the step that can
    fail, e.g. out of memory; nothing changes until `put_back`).

    Args:
        item: a served block.
        device: where to build them (None: where each target is now; placeholders follow
            ``model.to()``).
        targets: the Parameters they will fill (`restore_targets`; None: those taken).

    Returns:
        parameter name -> ``[E, ...]`` tensor in its original shape and its target's
        current dtype (a ``model.to(dtype)`` since enabling is honoured).
    """
    stored = item.provider.store.tensors
    targets = restore_targets(item) if targets is None else targets
    weights = {}
    # ordinary tensors even under torch.inference_mode(): inference tensors as parameters
    # would stop the model from ever taking gradients again, which it could before the cache
    with torch.inference_mode(False):
        for name, saved in item.saved.items():
            target = targets[name].device if device is None else device
            empty = torch.empty(saved.shape, dtype=targets[name].dtype, device=target)
            weights[name] = empty.copy_(stored[item.block.cache_name(name)])
    return weights


def put_back(
    item: ServedBlock, weights: dict[str, torch.Tensor], targets: dict[str, nn.Parameter] | None = None
) -> None:
    """Make ``weights`` (from `restored_weights`) the data of ``targets`` (`restore_targets`;
    None: the Parameter objects taken)."""
    targets = restore_targets(item) if targets is None else targets
    for name in item.saved:
        targets[name].data = weights[name]


def restore_block(item: ServedBlock, device: torch.device | None = None) -> None:
    """Write the store's bytes back into the taken Parameter objects (see `restored_weights`)."""
    put_back(item, restored_weights(item, device))


def bytes_needed(
    items: list[ServedBlock], device: torch.device | None = None, targets: list[dict[str, nn.Parameter]] | None = None
) -> dict[torch.device, int]:
    """Bytes `restored_weights` allocates, per device (``targets``: each item's `restore_targets`)."""
    needed: dict[torch.device, int] = {}
    for index, item in enumerate(items):
        filled = restore_targets(item) if targets is None else targets[index]
        for name, saved in item.saved.items():
            target = filled[name].device if device is None else device
            size = saved.shape.numel() * filled[name].element_size()
            needed[target] = needed.get(target, 0) + size
    return needed


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take on ``device`` (CUDA: free memory plus what torch's
    caching allocator holds unused); None where it is not measured (the CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
