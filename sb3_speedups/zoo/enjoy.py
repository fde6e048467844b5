"""Load a trained run and report its return (``sb3-speedups enjoy``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


from stable_baselines3.common.base_class import BaseAlgorithm

from sb3_speedups.errors import UserError
from sb3_speedups.zoo.evaluation import evaluate
from sb3_speedups.registry import get_algo
from sb3_speedups.zoo import runs
from sb3_speedups.zoo.envs import check_env_id, is_atari, make_env
from sb3_speedups.zoo.hyperparams import preprocess_hyperparams, read_hyperparams
from sb3_speedups.zoo.train import check_model_file


@dataclass
class EnjoyConfig:
    """
    :param algo: RL-Zoo algorithm name
    :param env_id: gymnasium id
    :param folder: a log folder (latest run of algo/env), a run folder, or a model ``.zip``
    :param exp_id: run id inside a log folder, 0 for the latest
    :param n_episodes: evaluation episodes
    :param load_best: load ``best_model.zip`` instead of the final model
    :param deterministic: deterministic actions
    :param seed: seed of the evaluation env
    :param device: torch device
    :param stock: load with the stock class
    """

    algo: str
    env_id: str
    folder: str = "logs"
    exp_id: int = 0
    n_episodes: int = 10
    load_best: bool = False
    deterministic: bool = True
    seed: int = 0
    device: str = "auto"
    stock: bool = False


@dataclass
class EnjoyResult:
    """:param model_path: the model evaluated; :param mean_return: mean; :param std_return: standard deviation"""

    model_path: Path
    mean_return: float
    std_return: float


def locate_model(config: EnjoyConfig) -> tuple[Path, Path]:
    """
    :return: ``(model zip, run folder)`` for the configured folder
    """
    folder = Path(config.folder)
    if not folder.exists():
        raise UserError(f"{folder} does not exist; pass -f with the log folder of train (logs), a run folder or a model .zip")
    if folder.suffix == ".zip":
        return check_model_file(str(folder)), folder.parent
    run_dir = folder
    if not (folder / f"{runs.run_name(config.env_id)}.zip").is_file() and not (folder / "best_model.zip").is_file():
        run_dir = runs.find_run_dir(folder, config.algo, config.env_id, config.exp_id)
    name = "best_model.zip" if config.load_best else f"{runs.run_name(config.env_id)}.zip"
    path = run_dir / name
    if not path.is_file():
        raise UserError(f"no {name} in {run_dir}; the run may have failed before saving (try --load-best)")
    return check_model_file(str(path)), run_dir


def enjoy(config: EnjoyConfig) -> EnjoyResult:
    """
    Evaluate a saved model on the env it was trained on, with its saved normalisation statistics.

    :param config: what to load
    :return: the model path and the return statistics
    """
    spec = get_algo(config.algo)
    check_env_id(config.env_id)
    model_path, run_dir = locate_model(config)
    conf_file = run_dir / runs.CONFIG_FILE
    raw = read_hyperparams(spec.name, config.env_id, conf_file if conf_file.is_file() else None, None, is_atari(config.env_id))
    hyperparams = preprocess_hyperparams(raw, n_timesteps=1)
    stats = run_dir / ("best_vecnormalize.pkl" if config.load_best else runs.VECNORMALIZE_FILE)
    env = make_env(config.env_id, hyperparams, 1, config.seed, eval_env=True, normalize_stats=stats)
    try:
        algo_cls: type[BaseAlgorithm] = spec.cls(stock=config.stock)
        model = algo_cls.load(model_path, env=env, device=config.device)
        mean_return, std_return = evaluate(model, env, config.n_episodes, config.deterministic)
    finally:
        env.close()
    print(f"{model_path}: mean return over {config.n_episodes} episodes: {mean_return:.2f} +/- {std_return:.2f}")
    return EnjoyResult(model_path, float(mean_return), float(std_return))
