"""
Hyperparameter search with Optuna: prepare the study, run trials in this process or in worker processes, write the
reports. Trials train with the zoo's functions (:mod:`sb3_speedups.tune.training`), so fixed hyperparameters
come from the YAML file and ``-params`` exactly as in ``train``, and the sampled ones override them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from sb3_speedups.errors import UserError
from sb3_speedups.registry import get_algo, import_object
from sb3_speedups.tune import reports
from sb3_speedups.tune.budget import check_rollouts_fit, fit_n_steps, max_rollout
from sb3_speedups.tune.config import TuneConfig, TunePlan
from sb3_speedups.tune.search_space import SearchSpace, apply_space_file, check_space_names
from sb3_speedups.tune.storage import (
    describe_storage,
    make_pruner,
    make_sampler,
    open_storage,
    quiet_optuna,
    storage_url,
    study_folder,
)
from sb3_speedups.tune.training import eval_points
from sb3_speedups.tune.trials import counts_toward_target, run_worker, worker_process_main
from sb3_speedups.tune.interrupts import clear_interrupt, interrupt_handler
from sb3_speedups.tune.workers import INTERRUPTED_EXIT_CODE, TrialSlots, run_worker_processes
from sb3_speedups.zoo import runs
from sb3_speedups.zoo.train import TrainConfig, prepare_experiment

__all__ = ["TuneConfig", "TuneResult", "prepare_tuning", "tune"]

SEARCH_SPACE_FILE = "search_space.yml"


@dataclass
class TuneResult:
    """
    :param folder: the study folder with the reports
    :param study_name: the study
    :param storage: where it is stored
    :param best_value: best objective so far, ``None`` when no trial completed
    :param best_hyperparams: path of the best-hyperparameters YAML, ``None`` when no trial completed
    :param interrupted: stopped by Ctrl-C / SIGTERM
    :param failed_workers: what ended each worker process that did not finish normally (killed, crashed)
    """

    folder: Path
    study_name: str
    storage: str
    best_value: float | None
    best_hyperparams: Path | None
    interrupted: bool = False
    failed_workers: list[str] = field(default_factory=list)


def _check_positive(config: TuneConfig) -> None:
    for name in ("n_trials", "n_jobs", "n_evaluations", "n_eval_episodes", "n_eval_envs", "trial_seeds"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"invalid --{name.replace('_', '-')} {value!r}: expected an integer >= 1")
    if config.n_startup_trials < 0:
        raise UserError(f"invalid --n-startup-trials {config.n_startup_trials}: expected an integer >= 0")
    if config.timeout is not None and config.timeout <= 0:
        raise UserError(f"invalid --timeout {config.timeout}: expected a number of seconds > 0")


def build_space(config: TuneConfig, algo_cls: type, base: dict[str, Any], rollout_limit: int | None = None) -> SearchSpace:
    """
    :param rollout_limit: the largest rollout (env steps) that fits between two evaluations, ``None`` for no limit
    :return: the built-in space of the algorithm (only the rollout sizes that fit), extended or replaced by
        ``config.search_space``
    """
    spec = get_algo(config.algo)
    space = import_object(spec.sampler)(algo_cls, base) if spec.sampler else SearchSpace()
    if rollout_limit is not None:
        space = fit_n_steps(space, algo_cls, base, rollout_limit)
    if config.search_space:
        space = apply_space_file(space, config.search_space)
    if not space.params:
        hint = "" if spec.sampler else f" ({spec.name} has no built-in space)"
        raise UserError(f"nothing to tune{hint}: pass --search-space with a YAML file that lists parameters to sample")
    check_space_names(space, algo_cls, base, spec.name)
    if rollout_limit is not None:
        check_rollouts_fit(space, algo_cls, base, rollout_limit)
    return space


def prepare_tuning(config: TuneConfig) -> TunePlan:
    """
    Check the settings, the algorithm, the env, the hyperparameters and the search space. Nothing is written.

    :param config: the run's settings
    :return: the plan shared by the workers (seeds are filled in by :func:`open_study`)
    """
    _check_positive(config)
    make_sampler(config.sampler, config.n_startup_trials, 0)
    make_pruner(config.pruner, config.n_startup_trials, config.n_evaluations)
    experiment = prepare_experiment(
        TrainConfig(config.algo, config.env_id, config.n_timesteps, 0, config.conf_file, dict(config.hyperparams))
    )
    base = experiment.raw_hyperparams
    n_timesteps = experiment.hyperparams.n_timesteps
    limit = max_rollout(n_timesteps, config.n_evaluations, config.eval_freq)
    space = build_space(config, experiment.algo_cls, base, limit)
    study_name = config.study_name or f"{get_algo(config.algo).name}_{runs.run_name(config.env_id)}"
    folder = study_folder(config.log_folder, study_name)
    return TunePlan(
        config, study_name, folder, storage_url(config.storage, folder), space, base, n_timesteps,
        eval_points(n_timesteps, config.n_evaluations, config.eval_freq),
        deadline=time.time() + config.timeout if config.timeout else None,
    )  # fmt: skip


def _needs_retry(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.FAIL and "error" not in trial.user_attrs


def open_study(plan: TunePlan) -> optuna.Study:
    """
    Create the study or load it; check that a resumed study is the same experiment; re-queue the parameters of
    trials that were interrupted; fix the seeds of this run.

    :param plan: the run's plan (``seed`` and ``sampler_seed`` are set here)
    :return: the study
    """
    config = plan.config
    study = optuna.create_study(
        storage=open_storage(plan.storage), study_name=plan.study_name, direction="maximize", load_if_exists=True
    )
    attrs = study.user_attrs
    expected = {"algo": get_algo(config.algo).name, "env_id": config.env_id, "n_timesteps": plan.n_timesteps}
    for key, value in expected.items():
        if key in attrs and attrs[key] != value:
            raise UserError(
                f"study {plan.study_name!r} was run with {key}={attrs[key]!r}, not {value!r}; "
                "use the same settings to resume it, or another --study-name"
            )
    if "algo" not in attrs:
        for key, value in expected.items():
            study.set_user_attr(key, value)
        study.set_user_attr("command", " ".join(sys.argv))
    if config.seed is not None:
        plan.seed = config.seed
    elif "seed" in attrs:
        plan.seed = int(attrs["seed"])
    else:
        plan.seed = int(np.random.randint(2**31 - 1))
    if "seed" not in attrs:
        study.set_user_attr("seed", plan.seed)
    trials = study.get_trials(deepcopy=False)
    # a resumed run starts a fresh random sequence instead of proposing the first run's points again
    plan.sampler_seed = (plan.seed + 7919 * len(trials)) % 2**32
    retried = set(attrs.get("retried_trials", []))
    for trial in trials:
        if _needs_retry(trial) and trial.number not in retried:
            study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
            retried.add(trial.number)
    if retried != set(attrs.get("retried_trials", [])):
        study.set_user_attr("retried_trials", sorted(retried))
    return study


def _run_in_process(plan: TunePlan, slots: TrialSlots) -> None:
    if threading.current_thread() is not threading.main_thread():
        run_worker(0, plan, slots)
        return
    clear_interrupt()
    previous = signal.signal(signal.SIGINT, interrupt_handler), signal.signal(signal.SIGTERM, interrupt_handler)
    try:
        run_worker(0, plan, slots)
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        clear_interrupt()


def _print_header(plan: TunePlan, study: optuna.Study, remaining: int) -> None:
    config = plan.config
    algo_cls = get_algo(config.algo).cls(stock=config.stock)
    done = sum(counts_toward_target(t) for t in study.get_trials(deepcopy=False))
    workers = f"{config.n_jobs} worker process{'es' if config.n_jobs > 1 else ''}"
    print(
        f"Tuning {algo_cls.__module__}.{algo_cls.__name__} on {config.env_id}: {config.n_trials} trials of "
        f"{plan.n_timesteps} steps ({done} done, {remaining} to run), {workers}, {config.trial_seeds} seed(s) per trial, "
        f"sampler {config.sampler}, pruner {config.pruner}, {len(plan.eval_points)} evaluations per trial"
    )
    print(f"Study {plan.study_name!r} in {describe_storage(plan.storage)}; seed {plan.seed}", flush=True)
    processes, cores = config.n_jobs * config.trial_seeds, os.cpu_count() or 1
    if processes > cores:
        print(f"Note: {processes} training processes on {cores} CPU cores share them (fewer --n-jobs may be as fast)")


def tune(config: TuneConfig) -> TuneResult:
    """
    Run (or resume) a study and write its reports. Ctrl-C / SIGTERM fail the running trials, keep the study and
    still write the reports; the same call continues it later.

    :param config: the run's settings
    :return: where the reports are and the best result
    """
    plan = prepare_tuning(config)
    quiet_optuna(config.verbose)
    study = open_study(plan)
    plan.folder.mkdir(parents=True, exist_ok=True)
    runs.write_yaml(plan.folder / SEARCH_SPACE_FILE, plan.space.to_yaml())
    remaining = config.n_trials - sum(counts_toward_target(t) for t in study.get_trials(deepcopy=False))
    if config.verbose > 0:
        _print_header(plan, study, max(remaining, 0))
    interrupted, failed_workers = False, []
    try:
        if remaining > 0 and config.n_jobs == 1:
            _run_in_process(plan, TrialSlots(remaining))
        elif remaining > 0:
            n_jobs = min(config.n_jobs, remaining)
            codes = run_worker_processes(n_jobs, worker_process_main, (plan, TrialSlots(remaining, shared=True)))
            if INTERRUPTED_EXIT_CODE in codes:
                # Ctrl-C reached the workers, and they ended, before this process ran its own signal handler.
                raise KeyboardInterrupt
            failed_workers = [_describe_exit(worker, code) for worker, code in enumerate(codes) if code != 0]
    except KeyboardInterrupt:
        interrupted = True
        print("Interrupted: running trials are marked failed; run the same command again to continue", file=sys.stderr)
    study = optuna.load_study(study_name=plan.study_name, storage=open_storage(plan.storage))
    written = reports.write_reports(study, plan.folder, config)
    if config.verbose > 0:
        print(reports.summary(study, written, config.n_trials))
    best = reports.best_trial(study)
    return TuneResult(
        plan.folder, plan.study_name, plan.storage, None if best is None else best.value,
        written.get("best_hyperparams"), interrupted, failed_workers,
    )  # fmt: skip


def _describe_exit(worker: int, code: int) -> str:
    if code < 0:
        try:
            return f"worker {worker} was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"worker {worker} ended with exit code {code} (its error is printed above)"
