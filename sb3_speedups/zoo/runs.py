"""The run folder layout: ``<log_folder>/<algo>/<env>_<id>/`` and what is written in it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from sb3_speedups.common.save_util import atomic_write
from sb3_speedups.errors import UserError

CONFIG_FILE = "config.yml"
ARGS_FILE = "args.yml"
VECNORMALIZE_FILE = "vecnormalize.pkl"


def run_name(env_id: str) -> str:
    """:return: the env id as used in folder and file names (``module:Env-v0`` -> ``Env-v0``)"""
    return env_id.rpartition(":")[2]


def _run_ids(algo_dir: Path, env_id: str) -> list[int]:
    pattern = re.compile(rf"^{re.escape(run_name(env_id))}_(\d+)$")
    if not algo_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in algo_dir.iterdir() if p.is_dir() and (m := pattern.match(p.name)))


def new_run_dir(log_folder: str | Path, algo: str, env_id: str) -> Path:
    """
    Create the next run folder (ids count up from 1, as in the RL Zoo).

    :return: the new folder
    """
    algo_dir = Path(log_folder) / algo
    ids = _run_ids(algo_dir, env_id)
    run_dir = algo_dir / f"{run_name(env_id)}_{(ids[-1] if ids else 0) + 1}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def find_run_dir(log_folder: str | Path, algo: str, env_id: str, exp_id: int = 0) -> Path:
    """
    :param exp_id: run id, 0 for the latest
    :return: an existing run folder
    """
    algo_dir = Path(log_folder) / algo
    ids = _run_ids(algo_dir, env_id)
    if not ids:
        raise UserError(f"no runs of {algo} on {env_id} under {algo_dir}; train one first or pass -f with a run folder")
    wanted = ids[-1] if exp_id == 0 else exp_id
    if wanted not in ids:
        raise UserError(f"no run {run_name(env_id)}_{wanted} under {algo_dir}; existing ids: {ids}")
    return algo_dir / f"{run_name(env_id)}_{wanted}"


def plain(value: Any) -> Any:
    """:return: ``value`` as YAML data: tuples as lists, classes as dotted paths, other objects by ``repr``"""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def write_yaml(path: str | Path, data: dict[str, Any], comment: str = "") -> Path:
    """
    Write ``data`` as YAML atomically (tuples as lists, classes as dotted paths).

    :param comment: lines written first, each as a YAML comment
    """
    text = "".join(f"# {line}\n" for line in comment.splitlines()) + yaml.safe_dump(plain(data), sort_keys=False)
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def write_config(run_dir: Path, env_id: str, hyperparams: dict[str, Any]) -> Path:
    """
    ``config.yml``: the exact merged hyperparameters, in the hyperparameters-file format (usable with ``--conf-file``).
    """
    return write_yaml(run_dir / CONFIG_FILE, {env_id: dict(sorted(hyperparams.items()))})
