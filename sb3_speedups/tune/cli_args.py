"""Flags of ``sb3-speedups tune`` (named as the RL Zoo's ``--optimize`` flags where it has them)."""

from __future__ import annotations

import argparse
import sys

from sb3_speedups.tune import PRUNERS, SAMPLERS


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tune``."""
    from sb3_speedups.cli import _add_common
    from sb3_speedups.zoo.envs import VEC_ENV_CLASSES

    _add_common(parser)
    parser.add_argument("--n-trials", type=int, default=500, help="trials of the study to finish (resuming counts done ones)")
    parser.add_argument("--n-jobs", type=int, default=1, help="parallel worker processes on this machine")
    parser.add_argument("--sampler", default="tpe", choices=SAMPLERS, help="Optuna sampler")
    parser.add_argument("--pruner", default="median", choices=PRUNERS, help="Optuna pruner")
    parser.add_argument("--n-startup-trials", type=int, default=10, help="random trials before the sampler and pruner act")
    parser.add_argument("--n-evaluations", type=int, default=4, help="evaluations per trial (pruning points)")
    parser.add_argument("-n", "--n-timesteps", type=int, default=-1, help="budget per trial; default: the YAML's n_timesteps")
    parser.add_argument("--eval-freq", type=int, default=-1, help="evaluate every N env steps (instead of --n-evaluations)")
    parser.add_argument("--n-eval-episodes", "--eval-episodes", type=int, default=5, help="episodes per evaluation")
    parser.add_argument("--n-eval-envs", type=int, default=1, help="envs of the evaluation env")
    parser.add_argument(
        "--storage",
        default=None,
        help="default: SQLite file in the study folder; a .log file (journal, shared by processes of one machine) "
        "or a database URL such as postgresql://user:password@host/db (shared by several machines)",
    )
    parser.add_argument("--study-name", default=None, help="default: <algo>_<env>; the same name resumes or joins a study")
    parser.add_argument("--timeout", type=float, default=None, help="start no new trial after this many seconds")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler and of every trial (default: drawn)")
    parser.add_argument("-f", "--log-folder", default="logs", help="outputs go to <log-folder>/tune/<study-name>/")
    parser.add_argument("--search-space", default=None, help="YAML file extending (or replacing) the built-in search space")
    parser.add_argument("-conf", "--conf-file", default=None, help="RL-Zoo-format YAML file of the fixed hyperparameters")
    parser.add_argument(
        "-params", "--hyperparams", nargs="+", default=[], metavar="KEY:VALUE", help="fixed hyperparameters, e.g. n_envs:4"
    )
    parser.add_argument("--trial-seeds", type=int, default=1, help="seeds per trial; the objective is their mean return")
    parser.add_argument("--vec-env", default="dummy", choices=list(VEC_ENV_CLASSES), help="VecEnv type")
    parser.add_argument("--num-threads", type=int, default=-1, help="torch threads per process (default: 1 on CPU)")
    parser.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="write the PNG plots")
    parser.add_argument("--verbose", type=int, default=1, help="0 quiet, 1 a line per trial, 2 also Optuna's log")


def run_tune(args: argparse.Namespace) -> int:
    """
    ``tune``: run or resume a study; exit code 130 when interrupted, 1 when a worker process died or no trial
    completed.
    """
    import signal

    from sb3_speedups.tune.tuner import TuneConfig, tune
    from sb3_speedups.zoo.hyperparams import parse_overrides

    config = TuneConfig(
        algo=args.algo, env_id=args.env, n_trials=args.n_trials, n_jobs=args.n_jobs, sampler=args.sampler,
        pruner=args.pruner, n_startup_trials=args.n_startup_trials, n_evaluations=args.n_evaluations,
        n_timesteps=args.n_timesteps, eval_freq=args.eval_freq, n_eval_episodes=args.n_eval_episodes,
        n_eval_envs=args.n_eval_envs, storage=args.storage, study_name=args.study_name, timeout=args.timeout,
        seed=args.seed, log_folder=args.log_folder, search_space=args.search_space, conf_file=args.conf_file,
        hyperparams=parse_overrides(args.hyperparams), trial_seeds=args.trial_seeds, vec_env=args.vec_env,
        device=args.device, stock=args.stock, num_threads=args.num_threads, verbose=args.verbose, plots=args.plots,
    )  # fmt: skip
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        result = tune(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if result.interrupted:
        return 130
    if result.failed_workers:
        print(
            f"sb3-speedups tune: error: {'; '.join(result.failed_workers)}; the study is kept: run the same command "
            "to continue it",
            file=sys.stderr,
        )
        return 1
    return 0 if result.best_value is not None else 1


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
