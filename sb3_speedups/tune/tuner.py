"""
Hyperparameter search with Optuna: prepare the study, run trials in this process or in worker processes, write the
reports. Trials train with the zoo's functions (:mod:`sb3_speedups.tune.training`), so fixed hyperparameters
come from the YAML file and ``-params`` exactly as in ``train``, and the sampled ones override them.
"""

from __future__ import annotations

import os
import signal
import socket
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
from sb3_speedups.tune.spaces import SearchSpace, apply_space_file, check_space_names, merge_hyperparams
from sb3_speedups.tune.storage import (
    describe_storage,
    make_pruner,
    make_sampler,
    open_storage,
    quiet_optuna,
    storage_url,
    study_folder,
)
from sb3_speedups.tune.training import TrialJob, eval_points
from sb3_speedups.tune.workers import SeedGroup, TrialSlots, describe_error, interrupt_handler, run_worker_processes
from sb3_speedups.zoo import runs
from sb3_speedups.zoo.train import TrainConfig, prepare_experiment

SEARCH_SPACE_FILE = "search_space.yml"


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
    :param verbose: 0 quiet, 1 one line per trial, 2 also Optuna's log
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


@dataclass
class TuneResult:
    """
    :param folder: the study folder with the reports
    :param study_name: the study
    :param storage: where it is stored
    :param best_value: best objective so far, ``None`` when no trial completed
    :param best_hyperparams: path of the best-hyperparameters YAML, ``None`` when no trial completed
    :param interrupted: stopped by Ctrl-C / SIGTERM
    """

    folder: Path
    study_name: str
    storage: str
    best_value: float | None
    best_hyperparams: Path | None
    interrupted: bool = False


def _check_positive(config: TuneConfig) -> None:
    for name in ("n_trials", "n_jobs", "n_evaluations", "n_eval_episodes", "n_eval_envs", "trial_seeds"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"invalid --{name.replace('_', '-')} {value!r}: expected an integer >= 1")
    if config.n_startup_trials < 0:
        raise UserError(f"invalid --n-startup-trials {config.n_startup_trials}: expected an integer >= 0")
    if config.timeout is not None and config.timeout <= 0:
        raise UserError(f"invalid --timeout {config.timeout}: expected a number of seconds > 0")


def build_space(config: TuneConfig, algo_cls: type, base: dict[str, Any]) -> SearchSpace:
    """
    :return: the built-in space of the algorithm, extended or replaced by ``config.search_space``
    """
    spec = get_algo(config.algo)
    space = import_object(spec.sampler)(algo_cls, base) if spec.sampler else SearchSpace()
    if config.search_space:
        space = apply_space_file(space, config.search_space)
    if not space.params:
        hint = "" if spec.sampler else f" ({spec.name} has no built-in space)"
        raise UserError(f"nothing to tune{hint}: pass --search-space with a YAML file that lists parameters to sample")
    check_space_names(space, algo_cls, base, spec.name)
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
    space = build_space(config, experiment.algo_cls, base)
    study_name = config.study_name or f"{get_algo(config.algo).name}_{runs.run_name(config.env_id)}"
    folder = study_folder(config.log_folder, study_name)
    n_timesteps = experiment.hyperparams.n_timesteps
    return TunePlan(
        config, study_name, folder, storage_url(config.storage, folder), space, base, n_timesteps,
        eval_points(n_timesteps, config.n_evaluations, config.eval_freq),
        deadline=time.time() + config.timeout if config.timeout else None,
    )  # fmt: skip


def counts_toward_target(trial: FrozenTrial) -> bool:
    """
    :return: whether a trial counts as done (or being done) for ``--n-trials``; interrupted trials (and trials
        whose process died) do not: they are retried
    """
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING):
        return True
    return trial.state == TrialState.FAIL and "error" in trial.user_attrs


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


def trial_seeds(seed: int, number: int, count: int) -> list[int]:
    """:return: the training seeds of trial ``number`` (distinct across trials and seeds)"""
    return [(seed + 1000 * number + k) % (2**31 - 1) for k in range(count)]


class Objective:
    """
    One trial: sample, merge with the fixed hyperparameters, train every seed, report the mean after each
    evaluation, return the mean final return. Errors are recorded on the trial (``error``) before it fails.

    :param plan: the run's plan
    :param worker: this worker's index
    """

    def __init__(self, plan: TunePlan, worker: int) -> None:
        self.plan = plan
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{worker}"
        self.seed_group = SeedGroup(plan.config.trial_seeds - 1)

    def job(self, hyperparams: dict[str, Any]) -> TrialJob:
        """:return: what each seed of a trial with these hyperparameters trains"""
        config = self.plan.config
        return TrialJob(
            config.algo, config.env_id, hyperparams, self.plan.n_timesteps, self.plan.eval_points, config.n_eval_episodes,
            config.n_eval_envs, config.conf_file, config.vec_env, config.device, config.stock, config.num_threads,
            verbose=max(config.verbose - 2, 0),
        )  # fmt: skip

    def __call__(self, trial: optuna.Trial) -> float:
        space = self.plan.space
        trial.set_user_attr("worker", self.worker)
        try:
            hyperparams = merge_hyperparams(self.plan.base, space.sample(trial), space.constraints)
            trial.set_user_attr("hyperparams", reports.plain(hyperparams))
            seeds = trial_seeds(self.plan.seed, trial.number, self.plan.config.trial_seeds)
            trial.set_user_attr("seeds", seeds)
            results = self.seed_group.run(self.job(hyperparams), seeds, lambda i, values: self.report(trial, i, values))
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            raise
        except Exception as exc:
            trial.set_user_attr("error", describe_error(exc))
            raise
        if results[0].pruned:
            raise optuna.TrialPruned(f"pruned at evaluation {len(results[0].returns)}")
        finals = [result.returns[-1] for result in results]
        trial.set_user_attr("seed_returns", finals)
        trial.set_user_attr("return_std", float(np.std(finals)))
        return float(np.mean(finals))

    def report(self, trial: optuna.Trial, index: int, values: list[float]) -> bool:
        """Report the mean return of all seeds; the last evaluation is the result, never a pruning point."""
        trial.report(float(np.mean(values)), index)
        return index >= len(self.plan.eval_points) or not trial.should_prune()

    def close(self) -> None:
        """End the seed helper processes."""
        self.seed_group.close()


class Progress:
    """Optuna callback printing one line per finished trial (the progress display of every worker)."""

    def __init__(self, plan: TunePlan, worker: int) -> None:
        self.plan = plan
        self.prefix = f"w{worker} " if plan.config.n_jobs > 1 else ""

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.plan.config.verbose <= 0:
            return
        trials = study.get_trials(deepcopy=False)
        done = sum(counts_toward_target(t) and t.state != TrialState.RUNNING for t in trials)
        complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        best = max(complete, key=lambda t: t.value, default=None)  # type: ignore[arg-type, return-value]
        value = "" if trial.value is None else f"return {trial.value:8.2f}"
        if "return_std" in trial.user_attrs and self.plan.config.trial_seeds > 1:
            value += f" +/- {trial.user_attrs['return_std']:.2f}"
        best_text = f"best {best.value:.2f} (trial {best.number})" if best is not None else "best -"
        seconds = trial.duration.total_seconds() if trial.duration else 0.0
        count = f"[{done:>3}/{self.plan.config.n_trials}]"
        line = f"{self.prefix}{count} trial {trial.number:>3} {trial.state.name:<8} {value:<18} {best_text}  {seconds:6.1f}s"
        if "error" in trial.user_attrs:
            line += f"  error: {trial.user_attrs['error']}"
        print(line, flush=True)


def _target_reached(study: optuna.Study, n_trials: int) -> bool:
    return sum(counts_toward_target(t) for t in study.get_trials(deepcopy=False)) >= n_trials


def run_worker(worker: int, plan: TunePlan, slots: TrialSlots) -> None:
    """
    Run trials until the study has ``n_trials``, the slots of this run are used up or the timeout passed.

    :param worker: index of this worker (its sampler seed is offset by it)
    :param plan: the run's plan
    :param slots: trial slots shared by this run's workers
    """
    config = plan.config
    quiet_optuna(config.verbose)
    study = optuna.load_study(
        study_name=plan.study_name,
        storage=open_storage(plan.storage),
        sampler=make_sampler(config.sampler, config.n_startup_trials, (plan.sampler_seed + worker) % 2**32),
        pruner=make_pruner(config.pruner, config.n_startup_trials, len(plan.eval_points)),
    )
    objective, progress = Objective(plan, worker), Progress(plan, worker)
    try:
        while (plan.deadline is None or time.time() < plan.deadline) and not _target_reached(study, config.n_trials):
            if not slots.take():
                break
            study.optimize(objective, n_trials=1, catch=(Exception,), callbacks=[progress], gc_after_trial=True)
    finally:
        objective.close()


def worker_process_main(worker: int, plan: TunePlan, slots: TrialSlots) -> None:
    """Entry point of a worker process: SIGINT/SIGTERM fail its running trial and end it."""
    signal.signal(signal.SIGINT, interrupt_handler)
    signal.signal(signal.SIGTERM, interrupt_handler)
    try:
        run_worker(worker, plan, slots)
    except KeyboardInterrupt:
        sys.exit(130)


def _run_in_process(plan: TunePlan, slots: TrialSlots) -> None:
    if threading.current_thread() is not threading.main_thread():
        run_worker(0, plan, slots)
        return
    previous = signal.signal(signal.SIGINT, interrupt_handler), signal.signal(signal.SIGTERM, interrupt_handler)
    try:
        run_worker(0, plan, slots)
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


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
    interrupted = False
    try:
        if remaining > 0 and config.n_jobs == 1:
            _run_in_process(plan, TrialSlots(remaining))
        elif remaining > 0:
            n_jobs = min(config.n_jobs, remaining)
            run_worker_processes(n_jobs, worker_process_main, (plan, TrialSlots(remaining, shared=True)))
    except KeyboardInterrupt:
        interrupted = True
        print("Interrupted: running trials are marked failed; run the same command again to continue", file=sys.stderr)
    study = optuna.load_study(study_name=plan.study_name, storage=open_storage(plan.storage))
    written = reports.write_reports(study, plan.folder, config.env_id, plots=config.plots)
    if config.verbose > 0:
        print(reports.summary(study, written, config.n_trials))
    best = reports.best_trial(study)
    return TuneResult(
        plan.folder, plan.study_name, plan.storage, None if best is None else best.value,
        written.get("best_hyperparams"), interrupted,
    )  # fmt: skip
