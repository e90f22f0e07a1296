"""A served model is not saved, copied or pickled: its expert parameters are placeholders.

While served, an experts module's per-expert parameters are empty placeholders (the weights
live in the cache's store and slots) and its config names the cache. ``state_dict()`` (so
``save_pretrained`` and ``torch.save(model.state_dict())``) returned the placeholders, a
checkpoint without experts; ``copy.deepcopy`` and pickling (``torch.save(model)``) made a
model without experts that no cache serves. Each served module carries a `SaveGuard`,
registered as its state-dict pre-hook (so it travels in the module's hooks, where a deep
copy or a pickle meets it): all three raise, naming ``disable()``, before anything is
returned or written. ``unbind`` removes it (`dispatch`). ``save_pretrained`` writes
``config.json`` before it asks for the state dict, so each transformers model above the
experts also gets a SaveGuard as its ``save_pretrained``, refusing at the call
(`model_guards`).
"""

from __future__ import annotations

from typing import NoReturn

#: What a SaveGuard refuses when called as a state-dict pre-hook.
STATE_DICT = "state_dict() (save_pretrained, torch.save(model.state_dict()))"


class SaveGuard:
    """Refuses ``state_dict``, ``copy.deepcopy`` and pickling of the module it guards, and
    any call of itself (as a state-dict pre-hook, or standing in for ``save_pretrained``).

    Args:
        where: names the served module in the error (``"Qwen3MoeExperts"``).
        what: names what a call of it does, in the error.
    """

    def __init__(self, where: str, what: str = STATE_DICT) -> None:
        self.where = where
        self.what = what

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse(self.what)

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
