"""What a tuning run leaves in its study folder: best hyperparameters (YAML), all trials (CSV), plots (PNG), summary."""

from __future__ import annotations

import csv
import io
import math
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from sb3_speedups.common.save_util import atomic_write
from sb3_speedups.tune.config import TuneConfig
from sb3_speedups.zoo import runs

BEST_FILE = "best_hyperparams.yml"
TRIALS_FILE = "trials.csv"
HISTORY_FILE = "history.png"
IMPORTANCES_FILE = "importances.png"
MIN_TRIALS_FOR_IMPORTANCES = 2


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """:return: the completed trial with the highest return, ``None`` before any completed"""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    return max(complete, key=lambda t: t.value, default=None)  # type: ignore[arg-type, return-value]


def reproduce_command(config: TuneConfig, path: Path, seed: int) -> str:
    """:return: the ``train`` command that retrains one seed of a trial and ends with its final evaluation"""
    flags = [f"--algo {config.algo} --env {config.env_id} -conf {path} --seed {seed}"]
    flags.append(f"--eval-episodes {config.n_eval_episodes}")
    if config.n_eval_envs != 1:
        flags.append(f"--n-eval-envs {config.n_eval_envs}")
    if config.vec_env != "dummy":
        flags.append(f"--vec-env {config.vec_env}")
    if config.stock:
        flags.append("--stock")
    if config.device != "auto":
        flags.append(f"--device {config.device}")
    return "sb3-speedups train " + " ".join(flags)


def write_best_hyperparams(trial: FrozenTrial, config: TuneConfig, path: Path) -> Path:
    """
    The best trial's full hyperparameters as a hyperparameters file (usable as is with ``train --conf-file``);
    ``n_timesteps`` is the trial's budget. A comment at the top names its seeds and the command that retrains each.
    """
    seeds, returns = trial.user_attrs.get("seeds", []), trial.user_attrs.get("seed_returns", [])
    lines = [f"Trial {trial.number}: mean final return {trial.value:.2f} over seed(s) {', '.join(map(str, seeds))}."]
    for seed, value in zip(seeds, returns, strict=False):
        lines.append(f"Seed {seed} (final return {value:.2f}): {reproduce_command(config, path, seed)}")
    data = {config.env_id: dict(sorted(trial.user_attrs["hyperparams"].items()))}
    return runs.write_yaml(path, data, comment="\n".join(lines))


def write_trials_csv(study: optuna.Study, path: Path) -> Path:
    """One row per trial: number, state, return (the last evaluation for pruned trials), spread, time, params."""
    trials = study.get_trials(deepcopy=False)
    param_names = sorted({name for t in trials for name in t.params})
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["number", "state", "value", "return_std", "duration_s", "worker", "error", *param_names])
    for t in trials:
        duration = f"{t.duration.total_seconds():.2f}" if t.duration else ""
        writer.writerow([
            t.number, t.state.name, "" if t.value is None else t.value, t.user_attrs.get("return_std", ""), duration,
            t.user_attrs.get("worker", ""), t.user_attrs.get("error", ""), *[t.params.get(name, "") for name in param_names],
        ])  # fmt: skip
    text = out.getvalue()

    def write(tmp: Path) -> None:
        tmp.write_text(text)

    return atomic_write(path, write)


def plot_history(study: optuna.Study, path: Path) -> Path | None:
    """Return of each trial (pruned: its last evaluation) and the best so far, against the trial number."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    trials = [t for t in study.get_trials(deepcopy=False) if t.value is not None]
    if not trials:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for state, marker, color in ((TrialState.COMPLETE, "o", "tab:blue"), (TrialState.PRUNED, "x", "tab:gray")):
        chosen = [t for t in trials if t.state == state]
        values = [float(t.value or 0.0) for t in chosen]
        ax.scatter([t.number for t in chosen], values, marker=marker, color=color, label=state.name.lower())
    complete = sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.number)
    best, xs, ys = -math.inf, [], []
    for t in complete:
        best = max(best, float(t.value))  # type: ignore[arg-type]
        xs.append(t.number)
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="tab:red", label="best so far")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel("mean evaluation return")
    ax.set_title(f"Optimisation history: {study.study_name}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))


def plot_importances(study: optuna.Study, path: Path) -> Path | None:
    """Parameter importances (PED-ANOVA: no extra dependency); ``None`` when there are too few completed trials."""
    from matplotlib.figure import Figure
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    if len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < MIN_TRIALS_FOR_IMPORTANCES:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "too few trials" warnings: the plot says what it can
            importances = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator())
    except (ValueError, RuntimeError, ZeroDivisionError):
        return None
    if not importances:
        return None
    names = list(importances)[::-1]
    fig = Figure(figsize=(7, 0.8 + 0.35 * len(names)))
    ax = fig.subplots()
    ax.barh(names, [importances[n] for n in names], color="tab:blue")
    ax.set_xlabel("importance for the return")
    ax.set_title(f"Hyperparameter importances: {study.study_name}")
    fig.tight_layout()
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))


def write_reports(study: optuna.Study, folder: Path, config: TuneConfig) -> dict[str, Path]:
    """
    :param study: the study
    :param folder: the study folder
    :param config: the run's settings (env id, evaluation flags, ``plots``: also write the PNG plots)
    :return: name -> path of what was written
    """
    written = {"trials": write_trials_csv(study, folder / TRIALS_FILE)}
    best = best_trial(study)
    if best is not None and "hyperparams" in best.user_attrs:
        written["best_hyperparams"] = write_best_hyperparams(best, config, folder / BEST_FILE)
    if config.plots:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            print("No plots: matplotlib is not installed (pip install 'sb3-speedups[plots]')")
            return written
        for name, plot, file in (("history", plot_history, HISTORY_FILE), ("importances", plot_importances, IMPORTANCES_FILE)):
            result = plot(study, folder / file)
            if result is not None:
                written[name] = result
    return written


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def summary(study: optuna.Study, written: dict[str, Path], n_trials: int, top: int = 5) -> str:
    """:return: the table printed at the end: trial counts, the best trials, the best parameters, the files"""
    trials = study.get_trials(deepcopy=False)
    counts = {state.name.lower(): sum(t.state == state for t in trials) for state in TrialState}
    states = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
    lines = [f"Study {study.study_name}: {len(trials)} trials ({states}; target {n_trials})"]
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    complete.sort(key=lambda t: -float(t.value))  # type: ignore[arg-type]
    if complete:
        several_seeds = any(len(t.user_attrs.get("seed_returns", [])) > 1 for t in complete)
        header = ["trial", "return", *(["+/-"] if several_seeds else []), "seconds", "worker"]
        rows = [header]
        for t in complete[:top]:
            spread = [_short(t.user_attrs.get("return_std", ""))] if several_seeds else []
            seconds = f"{t.duration.total_seconds():.1f}" if t.duration else ""
            rows.append([str(t.number), f"{t.value:.2f}", *spread, seconds, str(t.user_attrs.get("worker", ""))])
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines.append(f"Best {min(top, len(complete))} of {len(complete)} completed trials:")
        lines.extend("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
        lines.append(f"Parameters of trial {complete[0].number}:")
        lines.extend(f"  {name}: {_short(value)}" for name, value in sorted(complete[0].params.items()))
    else:
        lines.append("No trial completed yet: see the errors in the CSV file below")
    lines.extend(f"{name.replace('_', ' ').capitalize()}: {path}" for name, path in written.items())
    return "\n".join(lines)
