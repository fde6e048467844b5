"""Run ours and stock alternately on the same config and seeds, each run in a fresh subprocess, and summarise."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sb3_speedups.bench.worker import VARIANTS, BenchRun, split_variant
from sb3_speedups.common.openmp import stock_environment
from sb3_speedups.errors import UserError


@dataclass
class BenchConfig:
    """
    :param algo: RL-Zoo algorithm name
    :param env_id: gymnasium id
    :param n_timesteps: budget per run (``-1``: the YAML's)
    :param seeds: seeds; every variant runs every seed
    :param variants: variants to compare, ``ours`` first (see :data:`~sb3_speedups.bench.worker.VARIANTS`); a variant
        may pick its own training VecEnv with ``@kind`` (``ours@batched``, ``ours@dummy``)
    :param conf_file: hyperparameters file of every variant (``None``: bundled)
    :param ours_conf_file: a different file for ``ours`` only (e.g. a recommended faster-learning config)
    :param hyperparams: overrides for every variant
    :param vec_env: VecEnv kind of the training env
    :param eval_episodes: episodes of the final deterministic evaluation
    :param curve_points: evaluations during training (learning curve, clock paused)
    :param target_return: time-to-target mode: stop at this mean evaluation return
    :param out_dir: where the JSON and PNG go
    :param device: torch device
    """

    algo: str
    env_id: str
    n_timesteps: int = -1
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    variants: list[str] = field(default_factory=lambda: ["ours", "stock"])
    conf_file: str | None = None
    ours_conf_file: str | None = None
    hyperparams: dict[str, Any] = field(default_factory=dict)
    vec_env: str = "dummy"
    eval_episodes: int = 10
    curve_points: int = 5
    target_return: float | None = None
    out_dir: str = "bench_results"
    device: str = "cpu"


def run_subprocess(run: BenchRun, timeout: float | None = None) -> dict[str, Any]:
    """
    :param run: one run
    :param timeout: seconds before the run is killed
    :return: the worker's result record
    """
    cmd = [sys.executable, "-m", "sb3_speedups.bench.worker", json.dumps(asdict(run))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    if split_variant(run.variant)[0] != "ours":
        env = stock_environment(env)  # the worker imports this package, yet stock's threads spin as stock's do
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"benchmark run {run.variant} seed {run.seed} failed (exit {proc.returncode}):\n{tail}")


def plan_runs(config: BenchConfig) -> list[BenchRun]:
    """
    The runs in the order they execute: per seed all variants, the order reversed every other seed (ABBA) so a
    drift in machine speed hits every variant alike.
    """
    from sb3_speedups.zoo.envs import VEC_ENV_CLASSES

    unknown = [v for v in config.variants if split_variant(v)[0] not in VARIANTS]
    if unknown or not config.variants:
        raise UserError(f"unknown benchmark variant(s) {unknown}; choose from: {', '.join(VARIANTS)} (optionally @<vec env>)")
    bad_vec = [v for v in config.variants if split_variant(v)[1] not in (None, *VEC_ENV_CLASSES)]
    if bad_vec:
        kinds = ", ".join(VEC_ENV_CLASSES)
        raise UserError(f"unknown VecEnv in benchmark variant(s) {bad_vec}; after '@' use one of: {kinds}")
    if len(set(config.variants)) != len(config.variants):
        raise UserError(f"benchmark variants repeat: {config.variants}")
    runs = []
    for i, seed in enumerate(config.seeds):
        order = config.variants if i % 2 == 0 else list(reversed(config.variants))
        for variant in order:
            base, vec_env = split_variant(variant)
            conf = config.ours_conf_file if base == "ours" and config.ours_conf_file else config.conf_file
            runs.append(
                BenchRun(
                    variant=variant,
                    algo=config.algo,
                    env_id=config.env_id,
                    seed=seed,
                    n_timesteps=config.n_timesteps,
                    conf_file=conf,
                    hyperparams=config.hyperparams,
                    vec_env=vec_env or config.vec_env,
                    device=config.device,
                    eval_episodes=config.eval_episodes,
                    curve_points=config.curve_points,
                    target_return=config.target_return,
                )
            )
    return runs


def summarize(records: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """
    :param records: worker results
    :param variants: variants in report order (``ours`` first when present)
    :return: per-variant medians, returns, memory, time-to-target, and speed-up ratios of ``ours`` vs each other
    """
    summary: dict[str, Any] = {"variants": {}, "speedup": {}}
    for variant in variants:
        rows = [r for r in records if r["variant"] == variant]
        if not rows:
            continue
        returns = [r["final_return_mean"] for r in rows]
        # a run that never reached the target counts with its full budget
        to_target = [r["time_to_target"] if r["reached_target"] else r["learn_seconds"] for r in rows]
        summary["variants"][variant] = {
            "class": rows[0]["class"],
            "num_threads": rows[0]["num_threads"],
            "runs": len(rows),
            "median_learn_seconds": statistics.median(r["learn_seconds"] for r in rows),
            "median_steps_per_second": statistics.median(r["steps_per_second"] for r in rows),
            "final_returns": returns,
            "median_final_return": statistics.median(returns),
            "median_peak_memory_mb": statistics.median(r["peak_memory_mb"] for r in rows),
            "success_rate": sum(r["reached_target"] for r in rows) / len(rows),
            "median_time_to_target": statistics.median(to_target),
        }
    # Ratios are against the first ``ours`` variant (``ours`` or e.g. ``ours@batched``).
    reference = next((v for v in summary["variants"] if split_variant(v)[0] == "ours"), None)
    summary["reference"] = reference
    ours = summary["variants"].get(reference) if reference else None
    for variant, stats in summary["variants"].items():
        if ours is None or variant == reference:
            continue
        key = "median_time_to_target" if records and records[0]["target_return"] is not None else "median_learn_seconds"
        summary["speedup"][variant] = stats[key] / ours[key]
    return summary


def run_benchmark(config: BenchConfig, timeout: float | None = None, log: Any = print) -> dict[str, Any]:
    """
    Run every planned run, write ``<out_dir>/<algo>_<env>.json`` and the learning-curve PNG.

    :param config: what to compare
    :param timeout: seconds per run
    :param log: progress printer
    :return: ``{"config", "records", "summary", "json", "png"}``
    """
    from sb3_speedups.bench.report import plot_curves

    records = []
    started = time.perf_counter()
    for run in plan_runs(config):
        record = run_subprocess(run, timeout)
        records.append(record)
        log(f"  {run.variant:<9} seed {run.seed}: learn {record['learn_seconds']:.2f} s, "
            f"{record['steps_per_second']:.0f} steps/s, final return {record['final_return_mean']:.1f}")  # fmt: skip
    summary = summarize(records, config.variants)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{config.algo}_{config.env_id.replace(':', '_')}" + ("_target" if config.target_return is not None else "")
    result = {
        "config": asdict(config),
        "command": " ".join(sys.argv),
        "wall_seconds": time.perf_counter() - started,
        "records": records,
        "summary": summary,
    }
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2))
    png_path = plot_curves(records, out_dir / f"{stem}.png", title=f"{config.algo} on {config.env_id}")
    return {**result, "json": str(json_path), "png": None if png_path is None else str(png_path)}
