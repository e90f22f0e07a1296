"""Expert parallelism across real processes: 2 and 4 ranks, gloo on the CPU.

Each rank's output equals the single-process reference exactly in fp32 over 60 random
steps (uneven and empty token counts, skipped choices, caches smaller than one step's
experts); each rank's resident set holds only its own experts; gathered statistics and
manifests agree with what every rank did. The checks run inside the ranks
(`parallel_worker`); a failing rank fails the test with its traceback.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from parallel_worker import check_rank
from process_groups import run_ranks

STEPS = 60


@pytest.mark.parametrize(
    "world_size, scheme, pacing",
    [
        pytest.param(2, "contiguous", False, id="2 ranks"),
        pytest.param(4, "round_robin", False, id="4 ranks, uneven 3,3,2,2, round robin"),
        pytest.param(2, "round_robin", True, id="2 ranks, copies paced in 200-byte chunks"),
    ],
)
def test_ranks_equal_the_single_process_layer(world_size, scheme, pacing):
    run_ranks(check_rank, world_size, world_size, scheme, STEPS, pacing, collective_timeout=timedelta(seconds=120))
