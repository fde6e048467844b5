"""
One benchmark run, executed in a fresh process (``python -m sb3_speedups.bench.worker '<json>'``) so that thread
settings, caches and peak memory of one run never leak into the next. Prints one JSON line with the result.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv, sync_envs_normalization

from sb3_speedups.bench.memory import PeakMemory
from sb3_speedups.zoo.evaluation import EVAL_SEED_OFFSET, evaluate

# Variants: ours (our class, its own defaults), stock (stock class, torch defaults), stock-1t (stock class with
# 1 torch thread and fused Adam: the best a user gets from stock SB3 by configuration alone). A variant may name the
# training VecEnv after an ``@`` (``ours@batched`` vs ``ours@dummy``), overriding ``--vec-env`` for it.
VARIANTS = ("ours", "stock", "stock-1t")


def split_variant(variant: str) -> tuple[str, str | None]:
    """:return: ``(base variant, VecEnv kind or None)`` of ``"ours"`` / ``"ours@batched"``"""
    base, _, vec_env = variant.partition("@")
    return base, vec_env or None


@dataclass
class BenchRun:
    """
    :param variant: one of :data:`VARIANTS`, optionally with ``@<vec env kind>`` (the VecEnv is then in ``vec_env``)
    :param algo: RL-Zoo algorithm name
    :param env_id: gymnasium id
    :param seed: seed of model and envs
    :param n_timesteps: budget (``-1``: the YAML's)
    :param conf_file: hyperparameters file (``None``: bundled)
    :param hyperparams: overrides
    :param vec_env: ``--vec-env`` kind of the training env
    :param device: torch device
    :param eval_episodes: episodes of the final deterministic evaluation
    :param curve_points: evaluations during training for the learning curve (0: none)
    :param target_return: stop as soon as an evaluation reaches this mean return (time-to-target mode)
    """

    variant: str
    algo: str
    env_id: str
    seed: int
    n_timesteps: int = -1
    conf_file: str | None = None
    hyperparams: dict[str, Any] = field(default_factory=dict)
    vec_env: str = "dummy"
    device: str = "cpu"
    eval_episodes: int = 10
    curve_points: int = 5
    target_return: float | None = None


class LearningCurveCallback(BaseCallback):
    """
    Evaluate every ``eval_every`` env steps, with the clock paused: ``curve`` holds (learn seconds excluding
    evaluation, env steps, mean return). With ``target_return`` it stops training once the mean reaches it.
    """

    def __init__(self, eval_env: VecEnv, eval_every: int, n_episodes: int, target_return: float | None) -> None:
        super().__init__()
        self.eval_env, self.eval_every, self.n_episodes, self.target_return = eval_env, eval_every, n_episodes, target_return
        self.next_eval = eval_every
        self.eval_seconds = 0.0
        self.start = 0.0
        self.curve: list[tuple[float, int, float]] = []
        self.reached_at: tuple[float, int] | None = None

    def _on_training_start(self) -> None:
        self.start = time.perf_counter()

    def learn_seconds(self) -> float:
        """:return: wall time in ``learn()`` so far, evaluations excluded"""
        return time.perf_counter() - self.start - self.eval_seconds

    def _on_step(self) -> bool:
        if self.num_timesteps < self.next_eval:
            return True
        self.next_eval += self.eval_every
        paused = time.perf_counter()
        sync_envs_normalization(self.training_env, self.eval_env)
        mean, _ = evaluate(self.model, self.eval_env, self.n_episodes)
        self.eval_seconds += time.perf_counter() - paused
        elapsed = self.learn_seconds()
        self.curve.append((elapsed, self.num_timesteps, float(mean)))
        if self.target_return is not None and mean >= self.target_return:
            self.reached_at = (elapsed, self.num_timesteps)
            return False
        return True


def use_fused_adam(model: Any) -> None:
    """
    Rebuild the policy's Adam optimizers (an actor-critic's one, or an off-policy actor's and critic's) as fused Adams
    with the same settings (SB3's own ``eps=1e-5`` for actor-critic policies included, which passing
    ``optimizer_kwargs`` would drop).

    :param model: a freshly built algorithm
    """
    for module in model.policy.modules():
        optimizer = getattr(module, "optimizer", None)
        if type(optimizer) is not th.optim.Adam or optimizer.defaults.get("fused"):
            continue
        settings = {k: v for k, v in optimizer.defaults.items() if k not in ("foreach", "fused")}
        groups = [{"params": group["params"]} for group in optimizer.param_groups]
        module.optimizer = th.optim.Adam(groups, **settings, fused=True)


def run(bench: BenchRun) -> dict[str, Any]:
    """
    Build the run with the zoo's own functions, time ``learn()``, evaluate.

    :param bench: what to run
    :return: the result record (JSON-serialisable)
    """
    from sb3_speedups.zoo.envs import make_env
    from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment

    variant, _ = split_variant(bench.variant)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {bench.variant!r}; choose one of {VARIANTS}")
    stock = variant != "ours"
    config = TrainConfig(
        algo=bench.algo, env_id=bench.env_id, n_timesteps=bench.n_timesteps, seed=bench.seed, conf_file=bench.conf_file,
        hyperparams=dict(bench.hyperparams), vec_env=bench.vec_env, device=bench.device, verbose=0, stock=stock,
    )  # fmt: skip
    experiment = prepare_experiment(config)
    if variant == "stock-1t":
        th.set_num_threads(1)
    hp = experiment.hyperparams
    with PeakMemory() as memory:
        env = make_env(bench.env_id, hp, hp.n_envs, bench.seed, vec_env=bench.vec_env)
        eval_env = make_env(bench.env_id, hp, 1, bench.seed + EVAL_SEED_OFFSET, eval_env=True)
        try:
            model = create_model(experiment, env)
            if variant == "stock-1t":
                use_fused_adam(model)
            every = max(hp.n_timesteps // bench.curve_points, 1) if bench.curve_points > 0 else hp.n_timesteps + 1
            curve = LearningCurveCallback(eval_env, every, max(bench.eval_episodes // 2, 1), bench.target_return)
            model.learn(hp.n_timesteps, callback=curve)
            learn_seconds = curve.learn_seconds()
            sync_envs_normalization(env, eval_env)
            mean, std = evaluate(model, eval_env, bench.eval_episodes, True)
            memory.sample()  # before the envs close: their workers count
        finally:
            env.close()
            eval_env.close()
    return {
        **asdict(bench),
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "num_threads": th.get_num_threads(),
        "learn_seconds": learn_seconds,
        "timesteps": int(model.num_timesteps),
        "steps_per_second": model.num_timesteps / learn_seconds,
        "final_return_mean": float(mean),
        "final_return_std": float(std),
        "curve": curve.curve,
        "reached_target": curve.reached_at is not None,
        "time_to_target": curve.reached_at[0] if curve.reached_at else None,
        "steps_to_target": curve.reached_at[1] if curve.reached_at else None,
        "peak_memory_mb": memory.peak_mb,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of the subprocess: one JSON argument in, one JSON line out."""
    args = sys.argv[1:] if argv is None else argv
    result = run(BenchRun(**json.loads(args[0])))
    print("BENCH_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
