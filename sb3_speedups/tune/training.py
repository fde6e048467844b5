"""
Training one seed of one trial with the zoo's own steps (prepare -> make envs -> make model -> learn), evaluating
at fixed points and asking after each evaluation whether to go on (the pruning hook).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv, sync_envs_normalization

from sb3_speedups.common.torch_utils import apply_num_threads, available_cpus
from sb3_speedups.tune.interrupts import raise_if_interrupted
from sb3_speedups.zoo.envs import is_atari, make_env
from sb3_speedups.zoo.evaluation import EVAL_SEED_OFFSET, evaluate
from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment
from sb3_speedups.zoo.validation import accepted_kwargs

# (evaluation number from 1, mean return) -> whether to keep training
Report = Callable[[int, float], bool]


@dataclass
class TrialJob:
    """
    What one seed of a trial trains; picklable, so helper processes can receive it.

    :param algo: RL-Zoo algorithm name
    :param env_id: gymnasium id
    :param hyperparams: the trial's full hyperparameters (YAML section merged with the sampled values)
    :param n_timesteps: training budget
    :param eval_points: env steps after which to evaluate; the last one is the budget
    :param n_eval_episodes: episodes per evaluation
    :param n_eval_envs: envs of the evaluation env
    :param conf_file: the hyperparameters file of the run (``None``: bundled)
    :param vec_env: ``--vec-env`` name
    :param device: torch device
    :param stock: use the stock SB3 / sb3-contrib class
    :param num_threads: torch threads, ``-1`` for the package default
    :param verbose: verbosity of the training, as :attr:`TrainConfig.verbose` (2: the model's logger tables)
    :param concurrent_trainers: trainings that run at once on this machine (workers x seeds per trial); PPO's split
        update (a helper process per training) only runs where each gets 2 CPUs
    """

    algo: str
    env_id: str
    hyperparams: dict[str, Any]
    n_timesteps: int
    eval_points: list[int]
    n_eval_episodes: int = 5
    n_eval_envs: int = 1
    conf_file: str | None = None
    vec_env: str = "dummy"
    device: str = "auto"
    stock: bool = False
    num_threads: int = -1
    verbose: int = 0
    concurrent_trainers: int = 1


def eval_points(n_timesteps: int, n_evaluations: int, eval_freq: int = -1) -> list[int]:
    """
    :param n_timesteps: the budget
    :param n_evaluations: evaluations spread evenly over the budget (used when ``eval_freq <= 0``)
    :param eval_freq: evaluate every this many env steps instead
    :return: increasing env-step thresholds ending at the budget
    """
    if eval_freq > 0:
        count = max(1, math.ceil(n_timesteps / eval_freq))
        return [min((i + 1) * eval_freq, n_timesteps) for i in range(count)]
    count = max(1, min(n_evaluations, n_timesteps))
    return [math.ceil(n_timesteps * (i + 1) / count) for i in range(count)]


class EvalReportCallback(BaseCallback):
    """
    Evaluate the policy each time the env-step count passes the next threshold and hand the mean return to
    ``report``; stop training when it says so (pruned). A NaN return raises instead of being reported. The last
    evaluation is left for after ``learn()`` (the last update comes after the last env step), on the eval env
    seeded afresh, as ``train`` evaluates at its end: the same model gives the same final return there.

    :param eval_env: the evaluation env
    :param points: env-step thresholds
    :param n_eval_episodes: episodes per evaluation
    :param deterministic: deterministic actions during evaluation
    :param report: receives (evaluation number, mean return), returns whether to go on
    :param eval_seed: the seed the evaluation env was made with
    """

    def __init__(
        self, eval_env: VecEnv, points: list[int], n_eval_episodes: int, deterministic: bool, report: Report, eval_seed: int
    ) -> None:
        super().__init__(verbose=0)
        self.eval_env = eval_env
        self.eval_seed = eval_seed
        self.points = points
        self.n_eval_episodes = n_eval_episodes
        self.deterministic = deterministic
        self.report = report
        self.returns: list[float] = []
        self.pruned = False

    @property
    def done(self) -> bool:
        """:return: whether every evaluation happened or training was stopped"""
        return self.pruned or len(self.returns) >= len(self.points)

    def _on_step(self) -> bool:
        raise_if_interrupted()
        if len(self.returns) < len(self.points) - 1 and self.num_timesteps >= self.points[len(self.returns)]:
            return self.evaluate()
        return True

    def evaluate(self) -> bool:
        """:return: whether to keep training after this evaluation"""
        sync_envs_normalization(self.training_env, self.eval_env)
        if len(self.returns) == len(self.points) - 1:
            self.eval_env.seed(self.eval_seed)
        mean_return, _ = evaluate(self.model, self.eval_env, self.n_eval_episodes, self.deterministic, warn=False)
        if not math.isfinite(mean_return):
            raise FloatingPointError(f"evaluation return is {mean_return} after {self.num_timesteps} steps")
        self.returns.append(mean_return)
        self.pruned = not self.report(len(self.returns), mean_return)
        return not self.pruned


@dataclass
class SeedResult:
    """:param returns: mean evaluation returns in order; :param pruned: whether training was stopped early"""

    returns: list[float] = field(default_factory=list)
    pruned: bool = False


def train_seed(job: TrialJob, seed: int, report: Report) -> SeedResult:
    """
    Train one seed of a trial; evaluate at each of ``job.eval_points`` (the last one right after ``learn``), calling
    ``report`` after each.

    :param job: the trial's settings
    :param seed: seed of the model and envs
    :param report: the pruning hook
    :return: the evaluation returns
    """
    config = TrainConfig(
        algo=job.algo, env_id=job.env_id, n_timesteps=job.n_timesteps, seed=seed, conf_file=job.conf_file,
        hyperparams=job.hyperparams, eval_freq=-1, eval_episodes=job.n_eval_episodes, n_eval_envs=job.n_eval_envs,
        vec_env=job.vec_env, device=job.device, num_threads=job.num_threads, verbose=job.verbose, stock=job.stock,
    )  # fmt: skip
    experiment = prepare_experiment(config)
    apply_num_threads(job.num_threads if job.num_threads > 0 else None)
    hp = experiment.hyperparams
    # PPO's split update takes a second core per training: not where the trainings at once already use them all
    if 2 * job.concurrent_trainers > available_cpus() and "split_update" in accepted_kwargs(experiment.algo_cls):
        hp.model_kwargs.setdefault("split_update", False)
    env = make_env(job.env_id, hp, hp.n_envs, seed, vec_env=job.vec_env)
    eval_env = make_env(job.env_id, hp, job.n_eval_envs, seed + EVAL_SEED_OFFSET, eval_env=True)
    try:
        model = create_model(experiment, env)
        # as the RL Zoo: Atari policies are evaluated stochastically (deterministic ones get stuck)
        callback = EvalReportCallback(
            eval_env, job.eval_points, job.n_eval_episodes, not is_atari(job.env_id), report, seed + EVAL_SEED_OFFSET
        )
        callbacks: list[BaseCallback] = [cls(**kwargs) for cls, kwargs in hp.callbacks]
        model.learn(hp.n_timesteps, callback=[*callbacks, callback])
        while not callback.done:
            callback.evaluate()
    finally:
        env.close()
        eval_env.close()
    return SeedResult(callback.returns, callback.pruned)
