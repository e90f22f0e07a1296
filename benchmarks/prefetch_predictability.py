"""Could a layer's misses be copied before its router runs? Speculation from routing alone.

At batch 1 a layer's misses are known only once its router has run, so its copies cannot
overlap the layers before it (the "serial" bound of `bench_batch.py`). This script asks
whether the routing itself predicts them well enough to prefetch: for each token and layer
``l + 1`` it scores every expert by how often it was chosen at ``l + 1`` together with the
experts this token chose at ``l`` (a co-occurrence table learned on the *other* requests of
the trace: leave one request out), and prefetches the ``P`` best-scored experts that are not
resident into a per-layer LRU pool (`expertcache.policies.LRUPolicy`) before the layer's
real ids arrive (at most the pool's slots). Reported per pool size and ``P``: misses per token (copies that wait for
the router), prefetched copies per token, how many of the misses the prefetch covered, and
all copies against no prefetch. A prefetch pays only where it covers misses without adding
copies: on a copy-bound step every wrong prefetch costs its bytes.

Run: ``python benchmarks/prefetch_predictability.py [--trace DIR] [--csv FILE]`` (CPU only,
seconds; default trace: the real Qwen3-30B-A3B one, all 48 layers).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import numpy as np

from expertcache.policies import LRUPolicy
from expertcache.trace.loaders import load_trace

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/traces/qwen3-30b-a3b-instruct-2507__local-moe-inference-stack"
)
FRACTIONS = (0.25, 0.5)
PREFETCHES = (0, 1, 2, 4, 8)


def co_occurrence(ids: np.ndarray, tokens: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L - 1, E, E]``: tokens (of ``tokens``) choosing ``e`` at layer ``l`` and ``f`` at ``l + 1``."""
    num_layers = ids.shape[1]
    table = np.zeros((num_layers - 1, num_experts, num_experts))
    for t in tokens:
        for layer in range(num_layers - 1):
            here, there = ids[t, layer], ids[t, layer + 1]
            if (here >= 0).all() and (there >= 0).all():
                table[layer][np.ix_(here, there)] += 1
    return table


class LayerPool:
    """One layer's resident experts under LRU: what a per-layer device pool would hold."""

    def __init__(self, slots: int) -> None:
        self.resident: set[int] = set()
        self.policy = LRUPolicy(slots)
        self.slots = slots

    def load(self, expert: int, protected: set[int]) -> None:
        if len(self.resident) >= self.slots:
            victim = self.policy.choose_victim(protected, expert)
            self.resident.discard(victim)
            self.policy.on_evict(victim)
        self.resident.add(expert)
        self.policy.on_miss(expert)

    def touch(self, expert: int) -> None:
        self.policy.on_hit(expert)


def replay(ids: np.ndarray, request_of: np.ndarray, tables: dict, slots: int, prefetch: int) -> dict:
    """Counts over the trace for one pool size and prefetch width."""
    num_tokens, num_layers, _ = ids.shape
    pools = [LayerPool(slots) for _ in range(num_layers)]
    misses = prefetched = covered = 0
    for t in range(num_tokens):
        table = tables[request_of[t]]
        for layer in range(num_layers):
            pool, need = pools[layer], {int(e) for e in ids[t, layer] if e >= 0}
            guessed: set[int] = set()
            if prefetch and layer > 0 and (ids[t, layer - 1] >= 0).all():
                score = table[layer - 1][ids[t, layer - 1]].sum(0)
                for expert in np.argsort(-score, kind="stable"):
                    if len(guessed) == min(prefetch, slots):  # a pool holds at most its slots
                        break
                    if int(expert) not in pool.resident:
                        guessed.add(int(expert))
                for expert in guessed:  # before the router: nothing of this layer is known
                    pool.load(expert, protected=guessed)
            prefetched += len(guessed)
            for expert in need:
                if expert in pool.resident:
                    pool.touch(expert)
                    covered += expert in guessed
                else:
                    pool.load(expert, protected=need)
                    misses += 1
    return {"misses": misses / num_tokens, "prefetched": prefetched / num_tokens, "covered": covered / num_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="a routing trace (file or folder) with >= 2 layers")
    parser.add_argument("--csv", help="append rows to this CSV file")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError) as error:
        parser.exit(2, f"prefetch_predictability: {error}\n")
    ids = trace.expert_ids.astype(np.int64)
    if ids.shape[1] < 2:
        parser.exit(2, f"prefetch_predictability: {args.trace} records {ids.shape[1]} layer; need 2 or more\n")
    starts = [int(s) for s in trace.request_starts] or [0]
    request_of = np.searchsorted(np.asarray(starts), np.arange(ids.shape[0]), side="right") - 1
    requests = sorted(set(request_of.tolist()))
    tables = {r: co_occurrence(ids, np.flatnonzero(request_of != r), trace.num_experts) for r in requests}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    print(f"{trace.model or args.trace}: {ids.shape[0]} tokens, {ids.shape[1]} layers x {trace.num_experts} "
          f"experts, top-{ids.shape[2]}, {len(requests)} requests (table learned leaving each one out)")  # fmt: skip
    print(f"{'cache':>6} {'P':>2} {'misses/tok':>10} {'prefetched/tok':>14} {'covered':>8} {'copies vs P=0':>13}")
    for fraction in FRACTIONS:
        slots = max(ids.shape[2], round(fraction * trace.num_experts))
        base = None
        for prefetch in PREFETCHES:
            got = replay(ids, request_of, tables, slots, prefetch)
            base = base or got
            copies = (got["misses"] + got["prefetched"]) / base["misses"]
            share = got["covered"] / (got["covered"] + got["misses"]) if got["covered"] + got["misses"] else 0.0
            print(f"{fraction:>6.0%} {prefetch:>2} {got['misses']:>10.1f} {got['prefetched']:>14.1f} "
                  f"{share:>8.1%} {copies:>13.2f}")  # fmt: skip
            rows.append({"commit": commit, "trace": trace.model or args.trace, "fraction": fraction, "slots": slots,
                         "prefetch": prefetch, "misses_per_token": got["misses"],
                         "prefetched_per_token": got["prefetched"], "covered_share": share,
                         "copies_vs_no_prefetch": copies})  # fmt: skip
    if args.csv:
        new = not Path(args.csv).exists()
        with open(args.csv, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
