"""A served model is not saved, copied or pickled: its expert parameters are placeholders.

While served, an experts module's per-expert parameters are empty placeholders (the weights
live in the cache's store and slots) and its config names the cache. ``state_dict()`` (so
``save_pretrained`` and ``torch.save(model.state_dict())``) returned the placeholders, a
checkpoint without experts; ``copy.deepcopy`` and pickling (``torch.save(model)``) made a
model without experts that no cache serves. Each served module carries a `SaveGuard`,
registered as its state-dict pre-hook (so it travels in the module's hooks, where a deep
copy or a pickle meets it): all three raise, naming ``disable()``, before anything is
returned or written. ``unbind`` removes it (`dispatch`).
"""

from __future__ import annotations

from typing import NoReturn

from torch import nn


class SaveGuard:
    """Refuses ``state_dict``, ``copy.deepcopy`` and pickling of the module it guards.

    Args:
        where: names the module in the error (``"Qwen3MoeExperts"``).
    """

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._refuse("state_dict() (save_pretrained, torch.save(model.state_dict()))")

    def __deepcopy__(self, memo: dict) -> NoReturn:
        self._refuse("copy.deepcopy")

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        self._refuse("pickling (torch.save(model))")

    def _refuse(self, what: str) -> NoReturn:
        raise RuntimeError(
            f"{what} of a model whose {self.where} is served by an expert cache: its expert parameters are empty "
            f"placeholders while served (the weights are in the cache), so the result would hold no experts. Call "
            f"disable() on the ExpertCacheHandle first (it puts the weights back; enable_expert_cache again "
            f"afterwards); the cache is unchanged"
        )
