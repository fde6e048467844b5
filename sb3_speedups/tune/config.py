"""The settings of a tuning run: what the user asked for, and the checked plan every worker process receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sb3_speedups.tune.search_space import SearchSpace


@dataclass
class TuneConfig:
    """
    Everything a tuning run needs (the CLI fills it; tests build it directly). Flags as in the RL Zoo.

    :param algo: RL-Zoo algorithm name
    :param env_id: gymnasium id
    :param n_trials: trials of the study to finish (a resumed study counts those it already has)
    :param n_jobs: worker processes on this machine
    :param sampler: ``tpe``, ``random`` or ``cmaes``
    :param pruner: ``median``, ``halving`` or ``none``
    :param n_startup_trials: random trials before the sampler models the results (and before median pruning)
    :param n_evaluations: evaluations per trial, spread over its budget (pruning points)
    :param n_timesteps: budget of each trial; ``-1`` takes the YAML's ``n_timesteps``
    :param eval_freq: evaluate every this many env steps instead of ``n_evaluations`` times (``<= 0``: off)
    :param n_eval_episodes: episodes per evaluation
    :param n_eval_envs: envs of the evaluation env
    :param storage: ``None`` (SQLite file in the study folder), a ``*.log`` journal file or a database URL
    :param study_name: ``None``: ``<algo>_<env>``
    :param timeout: start no new trial after this many seconds
    :param seed: seed of the sampler and of every trial's training (``None``: drawn, recorded in the study)
    :param log_folder: root of the outputs (``<log_folder>/tune/<study_name>/``)
    :param search_space: a search-space YAML file that extends or replaces the built-in space
    :param conf_file: hyperparameters file (``None``: bundled)
    :param hyperparams: fixed overrides (``-params``)
    :param trial_seeds: seeds trained per trial; the objective is their mean return
    :param vec_env: ``--vec-env`` name
    :param device: torch device
    :param stock: tune the stock SB3 / sb3-contrib class
    :param num_threads: torch threads per process, ``-1`` for the package default
    :param verbose: 0 quiet, 1 one line per trial, 2 also Optuna's log, 3 also the trainings' logger tables
    :param plots: write the PNG plots
    """

    algo: str
    env_id: str
    n_trials: int = 500
    n_jobs: int = 1
    sampler: str = "tpe"
    pruner: str = "median"
    n_startup_trials: int = 10
    n_evaluations: int = 4
    n_timesteps: int = -1
    eval_freq: int = -1
    n_eval_episodes: int = 5
    n_eval_envs: int = 1
    storage: str | None = None
    study_name: str | None = None
    timeout: float | None = None
    seed: int | None = None
    log_folder: str = "logs"
    search_space: str | None = None
    conf_file: str | None = None
    hyperparams: dict[str, Any] = field(default_factory=dict)
    trial_seeds: int = 1
    vec_env: str = "dummy"
    device: str = "auto"
    stock: bool = False
    num_threads: int = -1
    verbose: int = 1
    plots: bool = True


@dataclass
class TunePlan:
    """The checked, picklable settings every worker process receives."""

    config: TuneConfig
    study_name: str
    folder: Path
    storage: str
    space: SearchSpace
    base: dict[str, Any]
    n_timesteps: int
    eval_points: list[int]
    seed: int = 0
    sampler_seed: int = 0
    deadline: float | None = None
