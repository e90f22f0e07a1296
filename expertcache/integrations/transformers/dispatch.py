"""The ``"expertcache"`` experts implementation registered with transformers.

``@use_experts_implementation`` makes an experts module's ``forward`` look up
``config._experts_implementation`` in transformers' experts-function registry. The cache
registers one more entry there; a served module's config names it, and each call becomes::

    hidden [T, H], top_k_index [T, K] (expert ids), top_k_weights [T, K]
      -> provider.passes(top_k_index)            misses copied into slots, ids -> slot ids
      -> SlotView(module): the module with its per-expert parameters replaced by slot
         tensors ([N, ...]) and num_experts by N (see "what an implementation sees")
      -> the implementation the module used before (eager, grouped_mm, batched_mm, ...),
         unchanged, on the SlotView with the slot ids; summed over the passes

A call of one pass returns the implementation's result on the slots as it is: ``batched_mm``'s
bit for bit; implementations that loop over experts (``eager``, ``grouped_mm``) meet them in
slot order instead of expert order, so a token's contributions may be added in another order
(rounding differences; on the CPU ``grouped_mm``'s fp32 rows also depend on where an
expert's group sits). A call that may take several passes through ``batched_mm`` or
``grouped_mm`` (the float ones) hands them every (token, choice) pair as a token of its own in
each pass, takes each pair's row from its pass and sums the rows as they do: ``batched_mm``
bit-identical to the uncached call, ``grouped_mm`` as close as one call (`_pairs_in_passes`).
Other implementations' passes are summed in fp32 and rounded once: close to one call, not
bit-identical, since each pass's output is already rounded by transformers' code. An implementation that takes all passes at once (a `PassSummer` as its ``sums_passes``, like
the project's ``expertcache_quant`` kernels, which sum every (token, choice) in k order after
the last pass) is bit-identical at any size. An experts function may also carry
``check(view)``: called on a `SlotView` of the whole pool before anything is copied, so what
it refuses (raising) leaves the cache as it was.

so transformers' own expert computation runs on the slots: the cache is a weight provider,
not a second forward path. A call whose tokens need more distinct experts than there are
slots runs in expert-group passes (`expertcache.passes`): the strategy of the simulator and
the EP layer too, each expert copied at most once per call. transformers' implementations
do not skip -1 ids, so in each pass only the tokens with an id of that pass run (eagerly;
inside a CUDA graph every token runs), the other passes' ids pointed at one of this pass's
slots and weighted 0: no -1 ever reaches an implementation.

What an implementation sees: the whole pool (``N = S``, no copy) while ``S`` is within
what it handles uncached: any ``S`` for ``batched_mm`` (it gathers ``w[ids]`` itself), at
most `GROUPED_MM_MAX_GROUPS` for ``grouped_mm`` (torch's kernel refuses more groups), at
most the layer's experts ``E`` for every other one (``eager`` builds ``one_hot(ids, N + 1)``,
``[T, K, N + 1]`` int64). A larger pool (a global budget over many layers) is compacted per
pass: only the pass's slots, gathered into ``[N, ...]`` with ids renumbered ``0..N-1``;
``N`` is their number eagerly and a fixed ``min(E, T*K, S)`` inside a CUDA graph (no sync).

A forward pre-hook on each served module keeps two promises at every call: an
implementation chosen with ``model.set_experts_implementation(...)`` while served is
followed (the cache keeps serving, now wrapping that one; ``disable()`` leaves it
selected), and a dtype change of the model (``model.to(torch.bfloat16)``), which the
cached experts do not follow, is refused with an error saying what to do.
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from expertcache.cached_provider import CachedWeightProvider
from expertcache.passes import max_passes
from expertcache.result import ExpertWeightResult
from expertcache.trace.recorder import RoutingRecorder

#: The name under which the cache is registered in transformers' experts registry.
IMPLEMENTATION_NAME = "expertcache"

#: The most groups (experts) torch's ``grouped_mm`` takes in one call on CUDA.
GROUPED_MM_MAX_GROUPS = 1024

ExpertsFunction = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class PassSummer:
    """Marks an experts function that takes every pass of a call at once and sums them
    exactly (one result, bit-identical to the call on the full weights): set as its
    ``sums_passes`` attribute. Functions without it run once per pass, summed here.

    Attributes:
        applies: ``applies(hidden_states)``: whether it can run on these tokens' device.
        prepare: ``prepare(view)`` on a `SlotView` of the whole pool: what ``run`` computes
            with (the slot tensors every pass reads), raising ValueError for a module it
            cannot compute; called before anything is copied.
        run: ``run(prepared, pass_ids, hidden_states, top_k_weights)``, where ``pass_ids``
            yields each pass's ``[T, K]`` slot ids (-1 for other passes); take the next only
            after this one's kernels are enqueued (its copies may overwrite the slots).
    """

    applies: Callable[[torch.Tensor], bool]
    prepare: Callable[[SlotView], object]
    run: Callable[..., torch.Tensor]


@dataclass
class Selection:
    """The experts implementation that the blocks of one config run on the slots.

    Attributes:
        config: the (sub)config the blocks share; while served it names `IMPLEMENTATION_NAME`.
        name: the implementation to wrap (what the config named before, or what
            ``set_experts_implementation`` chose since).
    """

    config: object
    name: str


@dataclass
class Binding:
    """What serves one experts module while the cache is on.

    Attributes:
        provider: the layer's cached weight provider.
        inner: the experts function the module used before (called on a `SlotView`).
        parameter_of: cache name (``w1``, ``w2``, extras) -> the module's parameter name.
        layer: model layer index (for the routing trace).
        recorder: where to record ``top_k_index``, or None.
        selection: the shared choice of implementation (None: ``inner`` is fixed).
        implementation: the registry name ``inner`` was resolved from.
        dtypes: parameter name -> dtype of the cached experts (checked at every call).
        hook: the handle of the module's forward pre-hook (removed by `unbind`).
    """

    provider: CachedWeightProvider
    inner: ExpertsFunction
    parameter_of: dict[str, str]
    layer: int
    recorder: RoutingRecorder | None = None
    selection: Selection | None = None
    implementation: str = "eager"
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    hook: object = None


_BINDINGS: weakref.WeakKeyDictionary[nn.Module, Binding] = weakref.WeakKeyDictionary()


def bind(module: nn.Module, binding: Binding) -> None:
    """Serve ``module`` through ``binding`` (its config must name `IMPLEMENTATION_NAME`)."""
    if module in _BINDINGS:
        raise RuntimeError(f"{type(module).__name__} is already served by an expert cache")
    _BINDINGS[module] = binding
    binding.hook = module.register_forward_pre_hook(_before_forward)


def unbind(module: nn.Module) -> None:
    binding = _BINDINGS.pop(module, None)
    if binding is not None and binding.hook is not None:
        binding.hook.remove()  # type: ignore[attr-defined]


def is_bound(module: nn.Module) -> bool:
    return module in _BINDINGS


def binding_of(module: nn.Module) -> Binding | None:
    """What serves ``module`` (its provider, recorder, ...), or None when the cache does not."""
    return _BINDINGS.get(module)


def resolve(module: nn.Module, name: str) -> ExpertsFunction:
    """The experts function registered as ``name`` for ``module``'s class (``"eager"``: its
    own forward). Raises KeyError for a name the registry does not hold."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from expertcache.integrations.transformers.discovery import experts_interface_of

    interface = experts_interface_of(module) or ALL_EXPERTS_FUNCTIONS
    try:
        return interface.get_interface(str(name), original_forward(module))
    except KeyError:
        raise KeyError(
            f"experts implementation {name!r} is not registered for {type(module).__name__} "
            f"(its registry holds {', '.join(sorted(map(str, interface)))})"
        ) from None


def original_forward(module: nn.Module) -> ExpertsFunction:
    """The class's own forward under ``@use_experts_implementation`` (its ``"eager"``).

    transformers applies the decorator again each time it builds a quantized experts class
    (``replace_with_fp8_linear`` wraps ``FP8Experts`` once per expert block), so the wrappers
    nest: unwrap every one of them, or ``"eager"`` would dispatch on the config again.
    """
    dispatcher = type(module).forward
    forward = getattr(dispatcher, "__wrapped__")  # noqa: B009 - set by the decorator
    while getattr(forward, "__code__", None) is dispatcher.__code__:
        forward = forward.__wrapped__
    return forward


def chosen_implementation(selection: Selection) -> str:
    """The implementation the blocks of ``selection`` should run now: a name the config was
    given since (``set_experts_implementation``), else the one recorded."""
    named = getattr(selection.config, "_experts_implementation", None)
    return str(named) if named and named != IMPLEMENTATION_NAME else selection.name


def set_config_implementation(config: object, name: object) -> None:
    """Write ``config``'s experts implementation (the internal field, not the property: the
    property's setter also rewrites sub-configs)."""
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = name  # type: ignore[attr-defined]
    else:
        config._experts_implementation = name  # type: ignore[attr-defined]


def _before_forward(module: nn.Module, args: tuple) -> None:
    binding = _BINDINGS.get(module)
    if binding is None:
        return
    selection = binding.selection
    if selection is not None:
        name = chosen_implementation(selection)
        if name != binding.implementation:
            binding.inner = resolve(module, name)  # a bad name raises before anything changes
            binding.implementation = name
        selection.name = name
        if getattr(selection.config, "_experts_implementation", None) != IMPLEMENTATION_NAME:
            set_config_implementation(selection.config, IMPLEMENTATION_NAME)
    for parameter_name, dtype in binding.dtypes.items():
        now = getattr(module, parameter_name).dtype
        if now != dtype:
            raise RuntimeError(
                f"{type(module).__name__}.{parameter_name} was cast from {dtype} to {now} (model.to, .half(), "
                f".bfloat16()) after the expert cache was enabled, but the cache holds the experts in {dtype}: "
                f"the outputs would differ. Call disable() on the ExpertCacheHandle (it puts the experts back "
                f"in {now}), then enable_expert_cache again"
            )


class SlotView:
    """Stands in for an experts module during one call, reading slot tensors.

    Attribute lookups fall through to the module, except the per-expert parameters (slot
    tensors ``[N, ...]``) and ``num_experts`` (``N``). Methods defined on the module's
    class are bound to the view, so helpers that read weights through ``self`` read slots.
    """

    __slots__ = ("_module", "_tensors")

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], num_slots: int) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_tensors", {**tensors, "num_experts": num_slots})

    def with_sentinels(self) -> SlotView:
        """The same view, telling transformers' implementations that ids ``>= num_experts``
        are expert-parallel sentinels (``_is_expert_parallel``): skipped or weighted 0."""
        tensors = object.__getattribute__(self, "_tensors")
        module = object.__getattribute__(self, "_module")
        return SlotView(module, {**tensors, "_is_expert_parallel": True}, tensors["num_experts"])

    def __getattr__(self, name: str):
        tensors = object.__getattribute__(self, "_tensors")
        if name in tensors:
            return tensors[name]
        module = object.__getattribute__(self, "_module")
        attribute = inspect.getattr_static(type(module), name, None)
        if isinstance(attribute, types.FunctionType):
            return types.MethodType(attribute, self)
        return getattr(module, name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SlotView is read-only (tried to set {name!r})")


def most_experts(implementation: str, num_experts: int) -> int | None:
    """The largest ``N`` an implementation is handed uncompacted (None: any)."""
    if implementation == "batched_mm":
        return None
    if implementation == "grouped_mm":
        return GROUPED_MM_MAX_GROUPS
    return num_experts


def expertcache_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The registered experts function (same signature as transformers' own).

    Args:
        hidden_states: ``[T, H]`` tokens.
        top_k_index: ``[T, K]`` int64 global expert ids from the router.
        top_k_weights: ``[T, K]`` router weights.

    Returns:
        ``[T, H]``, what the module's previous implementation returns on the full weights.
    """
    binding = _BINDINGS.get(self)
    if binding is None:
        raise RuntimeError(
            f"{type(self).__name__}'s config selects the {IMPLEMENTATION_NAME!r} experts "
            f"implementation, but no expert cache serves this module: call "
            f"expertcache.integrations.transformers.enable_expert_cache(model, ...)"
        )
    if binding.recorder is not None:
        binding.recorder.record(binding.layer, top_k_index)
    # what the implementation cannot compute is refused before anything is copied
    summer = getattr(binding.inner, "sums_passes", None)
    if isinstance(summer, PassSummer) and summer.applies(hidden_states):
        prepared = summer.prepare(_pool_view(binding, self))
        passes = binding.provider.passes(top_k_index)
        return summer.run(prepared, (result.topk_ids for result in passes), hidden_states, top_k_weights)
    check = getattr(binding.inner, "check", None)
    if check is not None:
        check(_pool_view(binding, self))
    if _rows_per_pair(binding) and _may_take_passes(binding, top_k_index):
        return _pairs_in_passes(binding, self, hidden_states, top_k_index, top_k_weights)
    parts = []
    for result in binding.provider.passes(top_k_index):
        parts.append(_run_pass(binding, self, hidden_states, result, top_k_weights))
    if len(parts) == 1:
        return parts[0]
    # several passes: summed in fp32, rounded once (close to one call, not bit-identical:
    # each pass's output is already rounded by the implementation)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return total.to(parts[0].dtype)


def _rows_per_pair(binding: Binding) -> bool:
    """Whether the implementation is transformers' float ``batched_mm`` or ``grouped_mm``:
    each computes every (token, choice) row on its own (a ``[T*K]`` batch of GEMVs; a grouped
    GEMM over each expert's rows), then weights the rows and sums each token's ``K`` of them
    once, which `_pairs_in_passes` can redo exactly."""
    from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

    return binding.inner is batched_mm_experts_forward or binding.inner is grouped_mm_experts_forward


def _may_take_passes(binding: Binding, top_k_index: torch.Tensor) -> bool:
    """Whether a call of these ids can need more than one pass (from the shapes alone)."""
    provider = binding.provider
    return max_passes(top_k_index.numel(), provider.num_experts, provider.pool.num_slots) > 1


def _pairs_in_passes(
    binding: Binding,
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``batched_mm`` / ``grouped_mm`` over a call in passes, bit-identical to the uncached call.

    Each pass hands the implementation every (token, choice) pair as a token of its own with
    one choice and weight 1, so the rows come back unweighted and unrounded; the pairs of other
    passes carry transformers' expert-parallel sentinel (id ``N``): ``grouped_mm`` skips them,
    so each expert's group holds exactly its rows of the uncached call, and ``batched_mm`` runs
    them (all ``T*K`` pairs: the uncached call's batch of GEMVs) on a clamped slot. Each pair's
    row is taken from the pass that holds its expert, and the rows are weighted and summed per
    token as both do themselves (``rows * w``, ``view(T, K, H).sum(dim=1)``, cast to the hidden
    dtype). Used only for calls that may take several passes.
    """
    num_tokens, num_top_k = top_k_index.shape
    pair_hidden = hidden_states.repeat_interleave(num_top_k, dim=0)
    unit = torch.ones(pair_hidden.shape[0], 1, dtype=hidden_states.dtype, device=hidden_states.device)
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    fixed = capturing or torch.compiler.is_compiling()
    rows = None
    for result in binding.provider.passes(top_k_index):
        slots = {"w1": result.w1, "w2": result.w2, **result.extra}
        tensors = {binding.parameter_of[name]: tensor for name, tensor in slots.items()}
        ids = result.topk_ids.reshape(-1, 1)
        served = ids >= 0
        filler = ids.max().clamp(min=0)  # adds no slot to a compacted view
        view, local = _present(binding, module, tensors, torch.where(served, ids, filler), fixed=fixed)
        view = view.with_sentinels()
        part = binding.inner(view, pair_hidden, torch.where(served, local, view.num_experts), unit)
        rows = torch.where(served, part, torch.zeros_like(part) if rows is None else rows)
    assert rows is not None  # a call takes at least one pass
    weighted = rows * top_k_weights.reshape(-1, 1)
    return weighted.view(num_tokens, num_top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _pool_view(binding: Binding, module: nn.Module) -> SlotView:
    """The module over the whole pool's slot tensors (what every pass of a call reads)."""
    pool = binding.provider.pool
    return SlotView(module, {binding.parameter_of[name]: t for name, t in pool.tensors.items()}, pool.num_slots)


def _run_pass(
    binding: Binding,
    module: nn.Module,
    hidden_states: torch.Tensor,
    result: ExpertWeightResult,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The inner implementation on one pass's slots; ids of other passes contribute 0."""
    slots = {"w1": result.w1, "w2": result.w2, **result.extra}
    tensors = {binding.parameter_of[name]: tensor for name, tensor in slots.items()}
    ids = result.topk_ids
    served = ids >= 0
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    if torch.compiler.is_compiling() or capturing:
        # No sync: every token runs; a pass with no id at all is dropped by selection (its
        # filler slot may be free, full of NaN), never by multiplying.
        filler = ids.max().clamp(min=0)
        view, local = _present(binding, module, tensors, torch.where(served, ids, filler), fixed=True)
        part = binding.inner(view, hidden_states, local, top_k_weights * served)
        return torch.where(served.any(), part, torch.zeros_like(part))
    if bool(served.all()):
        view, local = _present(binding, module, tensors, ids, fixed=False)
        return binding.inner(view, hidden_states, local, top_k_weights)
    rows = served.any(dim=1).nonzero().squeeze(1)
    out = torch.zeros_like(hidden_states)
    if rows.numel():
        mine = ids[rows]
        filler = mine.max()  # some slot of this pass: loaded, finite
        mask = served[rows]
        view, local = _present(binding, module, tensors, torch.where(mask, mine, filler), fixed=False)
        part = binding.inner(view, hidden_states[rows], local, top_k_weights[rows] * mask)
        out = out.index_copy(0, rows, part.to(out.dtype))
    return out


def _present(
    binding: Binding, module: nn.Module, tensors: dict[str, torch.Tensor], ids: torch.Tensor, *, fixed: bool
) -> tuple[SlotView, torch.Tensor]:
    """The `SlotView` and ids to hand the implementation: the pool as it is, or (a pool
    larger than the implementation handles) only the slots ``ids`` use, renumbered.

    Args:
        ids: ``[T, K]`` slot ids, every one a slot of this pass (no -1).
        fixed: inside a CUDA graph / torch.compile: a fixed-size table, no host sync.
    """
    num_slots = binding.provider.pool.num_slots
    limit = most_experts(binding.implementation, binding.provider.num_experts)
    if limit is None or num_slots <= limit or ids.numel() == 0:
        return SlotView(module, tensors, num_slots), ids
    if fixed:
        size = min(binding.provider.num_experts, ids.numel(), num_slots)
        table, local = compact_slots(ids, size)
    else:
        table, local = torch.unique(ids, return_inverse=True)
    gathered = {name: tensor.index_select(0, table) for name, tensor in tensors.items()}
    return SlotView(module, gathered, int(table.numel())), local


def compact_slots(ids: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct values of ``ids`` in a ``[size]`` table, and ``ids`` renumbered into it,
    with fixed shapes and no host sync (CUDA-graph capturable).

    Args:
        ids: ``[T, K]`` non-negative slot ids with at most ``size`` distinct values.
        size: the table's length, ``>= 1``.

    Returns:
        ``table`` ``[size]`` (the distinct ids ascending, the unused tail repeating the
        smallest id) and ``local`` ``[T, K]`` int64 with ``table[local] == ids``.
    """
    flat = ids.reshape(-1)
    ordered, order = torch.sort(flat)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    rank = torch.cumsum(first, 0) - 1  # the table entry of each sorted id
    table = ordered[:1].expand(size).clone()
    table.scatter_(0, rank, ordered)  # equal ids write equal values: deterministic
    local = torch.empty_like(rank).scatter_(0, order, rank)
    return table, local.view(ids.shape)


def register(interface: object | None = None) -> bool:
    """Add the cache to transformers' experts registries (idempotent).

    Always to ``ALL_EXPERTS_FUNCTIONS`` and, where this transformers has it, the FP8
    registry ``ALL_FP8_EXPERTS_FUNCTIONS`` that ``FP8Experts`` dispatches through (5.17 and
    5.24); with ``interface``, also to that registry (any ``ExpertsInterface`` a decorated
    class was given, e.g. `quantized.MXFP4_EXPERTS_FUNCTIONS`).

    Returns:
        Whether the cache is registered in ``interface`` (True without one).
    """
    from transformers.integrations.moe import ExpertsInterface

    from expertcache.integrations.transformers import quantized

    ExpertsInterface.register(IMPLEMENTATION_NAME, expertcache_experts_forward)
    quantized.register()
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8 experts
        pass
    else:
        FP8ExpertsInterface.register(IMPLEMENTATION_NAME, expertcache_experts_forward)
    if interface is None:
        return True
    if isinstance(interface, ExpertsInterface) and IMPLEMENTATION_NAME not in interface:
        type(interface).register(IMPLEMENTATION_NAME, expertcache_experts_forward)
    return IMPLEMENTATION_NAME in interface  # type: ignore[operator]
