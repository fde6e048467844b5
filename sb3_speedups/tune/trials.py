"""
The trials of one worker: the objective (sample, merge, train every seed, report the mean), the progress line,
and the loop that runs trials until the study has enough of them.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from sb3_speedups.errors import UserError
from sb3_speedups.tune.config import TunePlan
from sb3_speedups.tune.search_space import merge_hyperparams
from sb3_speedups.tune.storage import make_pruner, make_sampler, open_storage, quiet_optuna
from sb3_speedups.registry import get_algo
from sb3_speedups.tune.budget import rollout_steps, trial_budget
from sb3_speedups.tune.training import TrialJob, eval_points
from sb3_speedups.zoo import runs
from sb3_speedups.tune.interrupts import interrupt_handler
from sb3_speedups.tune.workers import INTERRUPTED_EXIT_CODE, SeedGroup, TrialSlots, describe_error


def counts_toward_target(trial: FrozenTrial) -> bool:
    """
    :return: whether a trial counts as done (or being done) for ``--n-trials``; interrupted trials (and trials
        whose process died) do not: they are retried
    """
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING):
        return True
    return trial.state == TrialState.FAIL and "error" in trial.user_attrs


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
        self.algo_cls = get_algo(plan.config.algo).cls(stock=plan.config.stock)

    def job(self, hyperparams: dict[str, Any]) -> TrialJob:
        """
        :param hyperparams: the trial's merged hyperparameters; their ``n_timesteps`` is set to the trial's budget:
            the whole rollouts that fit in the study's (so that ``train`` with them trains exactly the same steps)
        :return: what each seed of a trial with these hyperparameters trains
        """
        config = self.plan.config
        budget = trial_budget(self.plan.n_timesteps, rollout_steps(self.algo_cls, hyperparams))
        hyperparams["n_timesteps"] = budget
        return TrialJob(
            config.algo, config.env_id, hyperparams, budget, eval_points(budget, config.n_evaluations, config.eval_freq),
            config.n_eval_episodes, config.n_eval_envs, config.conf_file, config.vec_env, config.device, config.stock,
            config.num_threads, verbose=max(config.verbose - 1, 0), concurrent_trainers=config.n_jobs * config.trial_seeds,
        )  # fmt: skip

    def __call__(self, trial: optuna.Trial) -> float:
        space = self.plan.space
        trial.set_user_attr("worker", self.worker)
        try:
            hyperparams = merge_hyperparams(self.plan.base, space.sample(trial), space.constraints)
            job = self.job(hyperparams)
            trial.set_user_attr("hyperparams", runs.plain(hyperparams))
            seeds = trial_seeds(self.plan.seed, trial.number, self.plan.config.trial_seeds)
            trial.set_user_attr("seeds", seeds)
            last = len(job.eval_points)
            results = self.seed_group.run(job, seeds, lambda i, values: self.report(trial, i, values, last))
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

    def report(self, trial: optuna.Trial, index: int, values: list[float], last: int) -> bool:
        """Report the mean return of all seeds; the last evaluation (number ``last``) is the result, never pruned."""
        trial.report(float(np.mean(values)), index)
        return index >= last or not trial.should_prune()

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
        sys.exit(INTERRUPTED_EXIT_CODE)
    except UserError as exc:
        print(f"sb3-speedups tune: worker {worker}: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
