"""
VecEnv benchmark: env-steps per second with random actions for several ``--vec-env`` kinds, and start-up time.

Throughput: every kind is built once, then they take turns stepping short blocks of the same pre-drawn random
actions (the order reversed every other round), so a change in machine load hits them all alike; the ratios vs
``DummyVecEnv`` and vs ``SubprocVecEnv`` are medians of per-round ratios. Start-up: each measurement (building
the VecEnv and its first ``reset``) runs in a fresh process, kinds alternating, per start method.

``python scripts/benchmark.py vec-env --env HalfCheetah-v5 --kinds batched batched:n_local=4 envpool``

``--step-cost-ms 2`` adds fixed CPU work to every env step (a stand-in for an expensive simulator); ``--kinds ray``
needs a Ray cluster: ``scripts/ray_local_cluster.sh`` starts a two-node one on loopback around the command.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.env_util import make_vec_env
from sb3_speedups.common.vec_env import BatchedSubprocVecEnv
from sb3_speedups.common.vec_env.startup import units_per_second
from sb3_speedups.common.vec_env.worker import burn
from sb3_speedups.errors import UserError
from sb3_speedups.zoo.envs import VEC_ENV_CLASSES, vec_env_class

PROCESS_KINDS = ("subproc", "batched")


class StepCostWrapper(gym.Wrapper):
    """
    Adds ``units`` of :func:`~sb3_speedups.common.vec_env.worker.burn` CPU work to every step (an env as expensive
    as a simulator, with the wrapped env's own dynamics).

    :param env: the env
    :param units: work units per step
    """

    def __init__(self, env: gym.Env, units: int) -> None:
        super().__init__(env)
        self.units = units

    def step(self, action: Any) -> Any:
        burn(self.units)
        return self.env.step(action)


def parse_kind(spec: str) -> tuple[str, dict[str, Any]]:
    """
    :param spec: a ``--vec-env`` name, optionally with constructor options: ``batched:n_local=4,spin_us=0``
    :return: the name and the options
    """
    name, _, options = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"bad VecEnv option {item!r} in {spec!r}; write name:key=value,key=value")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    if name not in VEC_ENV_CLASSES:
        raise UserError(f"unknown VecEnv kind {name!r}; choose from: {', '.join(VEC_ENV_CLASSES)}")
    return name, kwargs


def make_kind(
    spec: str, env_id: str, n_envs: int, seed: int = 0, start_method: str | None = None, step_units: int = 0
) -> VecEnv:
    """
    :param spec: ``--vec-env`` name, optionally with options (see :func:`parse_kind`)
    :param env_id: gymnasium id
    :param n_envs: number of envs
    :param seed: base seed
    :param start_method: start method of the process-based kinds (``None``: their default)
    :param step_units: extra CPU work per env step (:class:`StepCostWrapper`), 0 for none
    :return: the VecEnv, built as ``make_vec_env`` builds it for training (Monitor / VecMonitor included)
    """
    kind, kwargs = parse_kind(spec)
    method = start_method if kind in PROCESS_KINDS else None
    wrapper: dict[str, Any] = {}
    if step_units:
        wrapper = {"wrapper_class": StepCostWrapper, "wrapper_kwargs": {"units": step_units}}
    return make_vec_env(
        env_id, n_envs=n_envs, seed=seed, vec_env_cls=vec_env_class(kind), start_method=method, vec_env_kwargs=kwargs,
        **wrapper,
    )  # fmt: skip


def random_actions(action_space: gym.spaces.Space, n_envs: int, n_steps: int, seed: int = 0) -> np.ndarray:
    """:return: ``(n_steps, n_envs, ...)`` actions drawn from ``action_space`` before any timing starts"""
    space = gym.vector.utils.batch_space(action_space, n_envs)
    space.seed(seed)
    return np.stack([space.sample() for _ in range(n_steps)])


def measure_throughput(
    env_id: str,
    kinds: list[str],
    n_envs: int = 8,
    block_steps: int = 100,
    rounds: int = 20,
    seed: int = 0,
    start_method: str | None = None,
    step_cost_ms: float = 0.0,
) -> dict[str, Any]:
    """
    :param env_id: gymnasium id
    :param kinds: ``--vec-env`` names, optionally with options (``dummy`` and ``subproc`` are added as references)
    :param n_envs: number of envs
    :param block_steps: VecEnv steps per timed block
    :param rounds: blocks per kind
    :param seed: seed of the envs and of the random actions
    :param start_method: start method of the process-based kinds
    :param step_cost_ms: CPU work added to every env step, in milliseconds of this machine's CPU
    :return: per kind: median env-steps/s, median ratios vs ``dummy`` and ``subproc``, all block rates
    """
    kinds = list(dict.fromkeys(["dummy", "subproc", *kinds]))
    for kind in kinds:
        parse_kind(kind)  # bad specs fail before anything is started
    envs: dict[str, VecEnv] = {}
    step_units = int(step_cost_ms * 1e-3 * units_per_second()) if step_cost_ms > 0 else 0
    try:
        for kind in kinds:
            envs[kind] = make_kind(kind, env_id, n_envs, seed, start_method, step_units)
        actions = random_actions(envs["dummy"].action_space, n_envs, block_steps, seed)
        rates: dict[str, list[float]] = {kind: [] for kind in kinds}
        for env in envs.values():
            env.reset()
            for action in actions[: min(20, block_steps)]:
                env.step(action)
        for round_index in range(rounds):
            for kind in kinds if round_index % 2 == 0 else reversed(kinds):
                env = envs[kind]
                start = time.perf_counter()
                for action in actions:
                    env.step(action)
                rates[kind].append(block_steps * n_envs / (time.perf_counter() - start))
        details = {kind: _split_details(env) for kind, env in envs.items()}
    finally:
        for env in envs.values():
            env.close()
    summary = {}
    for kind, values in rates.items():
        per_round = np.asarray(values)
        summary[kind] = {
            "env_steps_per_s": float(np.median(per_round)),
            "vs_dummy": float(np.median(per_round / np.asarray(rates["dummy"]))),
            "vs_subproc": float(np.median(per_round / np.asarray(rates["subproc"]))),
            "block_rates": [round(v) for v in values],
            **details[kind],
        }
    return summary


def _split_details(env: VecEnv) -> dict[str, Any]:
    unwrapped = env.unwrapped
    if not isinstance(unwrapped, BatchedSubprocVecEnv):
        return {}
    return {"n_local": unwrapped.n_local, "n_workers": len(unwrapped.worker_pids())}


def _startup_child(kind: str, env_id: str, n_envs: int, start_method: str) -> None:
    start = time.perf_counter()
    env = make_kind(kind, env_id, n_envs, 0, start_method)
    env.reset()
    elapsed = time.perf_counter() - start
    env.close()
    print(f"STARTUP {elapsed}")


def measure_startup(env_id: str, kinds: list[str], n_envs: int, start_methods: list[str], repeats: int = 3) -> dict[str, Any]:
    """
    :param env_id: gymnasium id
    :param kinds: process-based ``--vec-env`` names to time
    :param n_envs: number of envs
    :param start_methods: start methods to try
    :param repeats: measurements per kind and start method
    :return: per start method and kind, median seconds to build the VecEnv and reset it (imports excluded)
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    results: dict[str, Any] = {}
    for method in start_methods:
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for repeat in range(repeats):
            for kind in kinds if repeat % 2 == 0 else reversed(kinds):
                cmd = [
                    sys.executable,
                    "-m",
                    "sb3_speedups.bench.vec_env",
                    kind,
                    method,
                    env_id,
                    str(n_envs),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("STARTUP ")]
                if not lines:
                    raise RuntimeError(f"start-up run of {kind} ({method}) failed:\n{proc.stderr[-2000:]}")
                times[kind].append(float(lines[-1].split()[1]))
        results[method] = {kind: {"median_s": float(np.median(ts)), "all_s": ts} for kind, ts in times.items()}
    return results


def format_summary(env_id: str, throughput: dict[str, Any], startup: dict[str, Any] | None) -> str:
    """:return: a plain-text table of the results"""
    lines = [f"{env_id}: env-steps/s with random actions (medians over alternating blocks)"]
    lines.append(f"{'kind':30s} {'steps/s':>10s} {'vs dummy':>9s} {'vs subproc':>11s}  split")
    for kind, row in throughput.items():
        split = f"n_local={row['n_local']} workers={row['n_workers']}" if "n_local" in row else ""
        lines.append(f"{kind:30s} {row['env_steps_per_s']:10.0f} {row['vs_dummy']:8.2f}x {row['vs_subproc']:10.2f}x  {split}")
    for method, rows in (startup or {}).items():
        lines.append(f"start-up ({method}): " + ", ".join(f"{kind} {row['median_s']:.2f}s" for kind, row in rows.items()))
    return "\n".join(lines)


def run_vec_env_benchmark(
    env_id: str,
    kinds: list[str],
    n_envs: int = 8,
    block_steps: int = 100,
    rounds: int = 20,
    start_method: str | None = None,
    startup_methods: list[str] | None = None,
    startup_repeats: int = 3,
    out: str | None = None,
    step_cost_ms: float = 0.0,
) -> str:
    """
    Throughput of every kind (``dummy`` and ``subproc`` always included) and, per start method, start-up time.

    :param env_id: gymnasium id
    :param kinds: ``--vec-env`` names, with options as ``batched:n_local=4,spin_us=0``
    :param n_envs: number of envs
    :param block_steps: VecEnv steps per timed block
    :param rounds: timed blocks per kind
    :param start_method: start method of the throughput runs
    :param startup_methods: start methods to time start-up for (none: skip)
    :param startup_repeats: start-up measurements per kind and method
    :param out: write the results as JSON here
    :param step_cost_ms: CPU work added to every env step, in milliseconds (start-up runs are without it)
    :return: the plain-text summary table
    """
    throughput = measure_throughput(
        env_id, kinds, n_envs, block_steps, rounds, start_method=start_method, step_cost_ms=step_cost_ms
    )
    startup = None
    if startup_methods:
        timed = [kind for kind in dict.fromkeys(["subproc", *kinds]) if parse_kind(kind)[0] in PROCESS_KINDS]
        startup = measure_startup(env_id, timed, n_envs, startup_methods, startup_repeats)
    if out:
        with open(out, "w") as file:
            results = {"env_id": env_id, "n_envs": n_envs, "step_cost_ms": step_cost_ms, "throughput": throughput}
            json.dump({**results, "startup": startup}, file, indent=2)
    label = f"{env_id} + {step_cost_ms:g} ms/step" if step_cost_ms > 0 else env_id
    return format_summary(label, throughput, startup)


if __name__ == "__main__":
    # only as the fresh child process of measure_startup: KIND METHOD ENV_ID N_ENVS
    kind, method, child_env_id, child_n_envs = sys.argv[1:5]
    _startup_child(kind, child_env_id, int(child_n_envs), method)
