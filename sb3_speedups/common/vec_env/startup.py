"""
Start-up measurements of :class:`~sb3_speedups.common.vec_env.batched_subproc.BatchedSubprocVecEnv`: the cost of
one env step (and of pickling its infos) on a throw-away env, then a rehearsal of each possible split (envs in
the main process vs in the workers) with synthetic CPU work of that cost, timed under the machine's current load.
The fastest split wins; on a cheap env like CartPole that is usually "everything in the main process".
"""

from __future__ import annotations

import copy
import math
import multiprocessing as mp
import os
from collections.abc import Callable
from time import perf_counter
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env.patch_gym import _patch_env

from sb3_speedups.common.vec_env.info_codec import InfoDecoder, InfoEncoder
from sb3_speedups.common.vec_env.worker import burn

# CPU seconds of the bookkeeping around env steps, from CPU accounting: per env stepped in the main process; per env
# stepped in a worker, on the worker's side; per step with workers, on the worker's side (control words, action copy)
# and on the main process's side (semaphores, payload, infos), plus per env of the workers on the main process's side.
LOCAL_ENV_OVERHEAD_S = 1.0e-6
WORKER_ENV_OVERHEAD_S = 2.0e-6
WORKER_STEP_OVERHEAD_S = 5.0e-6
MAIN_HANDOFF_S = 10.0e-6
MAIN_PER_REMOTE_ENV_S = 1.0e-6
# Wake-up latency of a go/done exchange on an idle machine; a split must beat in-process stepping by
# PARALLEL_GAIN even with it, else the workers are not even started.
MIN_ROUND_TRIP_S = 15e-6
PARALLEL_GAIN = 0.8
REHEARSAL_BUDGET_S = 0.15
# Rehearsed splits within this fraction of the fastest count as ties (the timings are that noisy).
SPLIT_TIE_FRACTION = 0.03
# A rehearsal whose splits spread less than this fraction of the spread the cost model predicts saw no parallel
# stepping at all: the other cores were busy for that moment (another process, the hypervisor). It is repeated, up
# to REHEARSAL_TRIES in all, so that one busy moment does not decide the split of a whole run.
FLAT_FRACTION = 0.5
REHEARSAL_TRIES = 3


def usable_cores() -> int:
    """:return: number of CPU cores this process may run on"""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover


def default_start_method() -> str:
    """:return: ``forkserver`` where available (SB3's default: safe with threads), else ``spawn``"""
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def measure_step_cost(env_fn: Callable[[], gym.Env], budget_s: float = 0.03, max_steps: int = 300) -> tuple[float, float]:
    """
    Median time of one step of a throw-away env made by ``env_fn`` (random actions, resets not counted), and of
    encoding and decoding its infos as a worker and the main process would.

    The env is closed afterwards; the VecEnv's own envs are created later and never stepped here. An error of its
    ``reset`` or ``step`` ends the timing unraised: stock VecEnvs raise it at the first use of their envs, not at
    creation (``make_vec_env(wrapper_class=RecordEpisodeStatistics)`` asserts at every episode end, for one).

    :param env_fn: makes one env
    :param budget_s: stop after this much stepping time
    :param max_steps: stop after this many steps
    :return: ``(seconds per step, seconds of info pickling per step)``; ``(0, 0)`` if no step completed
    """
    env = _patch_env(env_fn())
    step_times: list[float] = []
    info_times: list[float] = []
    try:
        _time_steps(env, budget_s, max_steps, step_times, info_times)
    except Exception:  # the VecEnv's own envs raise it when used, as stock's would
        pass
    finally:
        env.close()
    if not step_times:
        return 0.0, 0.0
    # Skip the first steps: caches and lazy initialisation make them slower than the rest.
    skip = 5 if len(step_times) > 10 else 0
    return float(np.median(step_times[skip:])), float(np.median(info_times[skip:]))


def _time_steps(env: gym.Env, budget_s: float, max_steps: int, step_times: list[float], info_times: list[float]) -> None:
    """Step ``env`` with random actions, appending the time of each step and of its infos' round trip."""
    # A copy, so that sampling does not move the RNG of a space that might be handed out later.
    action_space = copy.deepcopy(env.action_space)
    action_space.seed(0)
    env.reset(seed=0)
    encoder, decoder = InfoEncoder(), InfoDecoder()
    while len(step_times) < max_steps and sum(step_times) < budget_s:
        action = action_space.sample()
        start = perf_counter()
        _, _, terminated, truncated, info = env.step(action)
        step_time = perf_counter() - start
        start = perf_counter()
        if info:
            decoder.decode(encoder.encode([(0, info, None)]))
        info_times.append(perf_counter() - start)
        step_times.append(step_time)
        if terminated or truncated:
            env.reset()


def units_per_second(repeats: int = 5, units: int = 20_000) -> float:
    """:return: how many :func:`~sb3_speedups.common.vec_env.worker.burn` units this CPU does per second"""
    best = math.inf
    for _ in range(repeats):
        start = perf_counter()
        burn(units)
        best = min(best, perf_counter() - start)
    return units / max(best, 1e-9)


def _plans(n_envs: int, n_workers: int, step_cost: float, info_cost: float, candidates: list[int]) -> dict[int, tuple]:
    """Seconds of work of the main process and of each worker, per candidate number of envs in the main process."""
    plans: dict[int, tuple[float, float | None]] = {}
    for n_local in candidates:
        main_s = n_local * (step_cost + LOCAL_ENV_OVERHEAD_S)
        remote = n_envs - n_local
        worker_s = None
        if remote:
            main_s += MAIN_HANDOFF_S + remote * MAIN_PER_REMOTE_ENV_S
            worker_s = WORKER_STEP_OVERHEAD_S + math.ceil(remote / n_workers) * (step_cost + info_cost + WORKER_ENV_OVERHEAD_S)
        plans[n_local] = (main_s, worker_s)
    return plans


def model_step_times(plans: dict[int, tuple[float, float | None]]) -> dict[int, float]:
    """:return: seconds per step of each of :func:`_plans`' splits, with every process on a core of its own"""
    return {k: max(main_s, worker_s or 0.0) for k, (main_s, worker_s) in plans.items()}


def parallel_may_pay(n_envs: int, n_workers: int, step_cost: float, info_cost: float) -> bool:
    """
    :return: whether some split could beat stepping every env in the main process, even with the fastest
        possible worker round trip (if not, no worker is started)
    """
    plans = _plans(n_envs, n_workers, step_cost, info_cost, list(range(n_envs + 1)))
    best_split = min(max(main_s, MIN_ROUND_TRIP_S + worker_s) for main_s, worker_s in plans.values() if worker_s is not None)
    return best_split < PARALLEL_GAIN * plans[n_envs][0]


def choose_n_local(pool: Any, n_envs: int, step_cost: float, info_cost: float, keep_workers: bool) -> dict[int, float]:
    """
    Rehearse every split with synthetic work and return its mean step time.

    :param pool: the started :class:`~sb3_speedups.common.vec_env.pool.WorkerPool`
    :param n_envs: number of envs
    :param step_cost: seconds per env step
    :param info_cost: seconds of info pickling per env step in a worker
    :param keep_workers: the user asked for these workers: give each at least one env
    :return: mean seconds per step for each candidate number of envs in the main process
    """
    n_workers = len(pool.workers)
    candidates = list(range(n_envs - n_workers + 1)) if keep_workers else list(range(n_envs + 1))
    rate = units_per_second()
    model = _plans(n_envs, n_workers, step_cost, info_cost, candidates)
    plans = {
        k: (int(main_s * rate), None if worker_s is None else int(worker_s * rate)) for k, (main_s, worker_s) in model.items()
    }
    model_times = model_step_times(model)
    rounds = int(np.clip(REHEARSAL_BUDGET_S / max(sum(model_times.values()), 1e-9), 5, 40))
    steps = [plans[k] for _ in range(rounds) for k in candidates]
    split_times: dict[int, float] = {}
    for _ in range(REHEARSAL_TRIES):
        times = np.asarray(pool.rehearse(steps)).reshape(rounds, len(candidates))
        # Drop the first round (workers waking up, caches), keep the mean: rare long stalls are part of the cost.
        split_times = dict(zip(candidates, times[1:].mean(axis=0).tolist(), strict=True))
        if not rehearsal_is_flat(split_times, model_times):
            break
    return split_times


def rehearsal_is_flat(split_times: dict[int, float], model_times: dict[int, float]) -> bool:
    """
    :param split_times: rehearsed seconds per step for each number of envs in the main process
    :param model_times: the same as the cost model predicts them with every process on a core of its own
    :return: whether the rehearsed splits spread less than :data:`FLAT_FRACTION` of the model's spread (the
        rehearsal then saw no parallel stepping)
    """
    observed = max(split_times.values()) / max(min(split_times.values()), 1e-12) - 1.0
    predicted = max(model_times.values()) / max(min(model_times.values()), 1e-12) - 1.0
    return observed < FLAT_FRACTION * predicted


def pick_split(split_times: dict[int, float]) -> int:
    """
    :param split_times: mean seconds per step for each number of envs in the main process
    :return: the fewest envs in the main process among the splits within :data:`SPLIT_TIE_FRACTION` of the fastest
        (the main process also runs the policy and assembles every step's results, which the rehearsal does not
        time, so ties go to the workers)
    """
    best = min(split_times.values())
    return min(k for k, t in split_times.items() if t <= best * (1 + SPLIT_TIE_FRACTION))
