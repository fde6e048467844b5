"""How BatchedSubprocVecEnv chooses the envs its main process steps: the rehearsal's decision rules."""

from __future__ import annotations

import pytest

from sb3_speedups.common.vec_env import startup
from sb3_speedups.common.vec_env.startup import choose_n_local, pick_split, rehearsal_is_flat

# Rehearsals of FetchReach-v4 (4 envs, one worker, ~2.1 ms a step) on a 2-core EPYC, ms per step by envs in the main
# process: one taken while the other core was busy, one on the idle machine.
BUSY = {0: 8.368, 1: 8.125, 2: 8.162, 3: 8.428, 4: 8.646}
IDLE = {0: 9.38, 1: 7.28, 2: 4.65, 3: 7.23, 4: 9.88}


def test_pick_split_prefers_workers_within_noise() -> None:
    assert pick_split({0: 1.0, 1: 0.5, 2: 0.51, 3: 0.9}) == 1
    assert pick_split({0: 1.0, 1: 0.52, 2: 0.505, 3: 0.5}) == 2  # 0.52 is more than 3% above the best
    assert pick_split({4: 0.2}) == 4


def test_a_rehearsal_without_parallel_stepping_is_flat() -> None:
    # The cost model predicts ~2x between the balanced split and the others.
    model = startup.model_step_times(startup._plans(4, 1, 2.1e-3, 0.0, list(range(5))))
    assert rehearsal_is_flat(BUSY, model)
    assert not rehearsal_is_flat(IDLE, model)
    assert pick_split(BUSY) == 0  # what the busy moment alone would choose: every env in the worker
    assert pick_split(IDLE) == 2
    # A single candidate (every worker kept busy by the user) has nothing to compare.
    assert not rehearsal_is_flat({3: 1.0}, {3: 1.0})


class ScriptedPool:
    """Stands in for the worker pool's timings, which a test cannot make flat on demand: one script per rehearsal."""

    def __init__(self, scripts: list[dict[int, float]]) -> None:
        self.workers = [object()]
        self.scripts = scripts
        self.calls = 0

    def rehearse(self, steps: list[tuple[int, int | None]]) -> list[float]:
        script = self.scripts[min(self.calls, len(self.scripts) - 1)]
        self.calls += 1
        per_round = [script[k] * 1e-3 for k in sorted(script)]
        assert len(steps) % len(per_round) == 0
        return per_round * (len(steps) // len(per_round))


@pytest.mark.parametrize(
    ("scripts", "calls", "n_local"),
    [([IDLE], 1, 2), ([BUSY, IDLE], 2, 2), ([BUSY, BUSY, BUSY, IDLE], startup.REHEARSAL_TRIES, 0)],
)
def test_a_flat_rehearsal_is_repeated(scripts: list[dict[int, float]], calls: int, n_local: int) -> None:
    pool = ScriptedPool(scripts)
    split_times = choose_n_local(pool, 4, 2.1e-3, 0.0, keep_workers=False)
    assert pool.calls == calls
    assert pick_split(split_times) == n_local
