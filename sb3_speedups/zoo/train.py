"""
One training run, as small steps that tests can call one by one:
load hyperparameters -> make envs -> make model -> learn (with evaluation and checkpoints) -> save.
"""

from __future__ import annotations

import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
from stable_baselines3.common.preprocessing import is_image_space
from stable_baselines3.common.noise import NormalActionNoise, OrnsteinUhlenbeckActionNoise
from stable_baselines3.common.vec_env import VecEnv, VecNormalize, sync_envs_normalization

from sb3_speedups.common.replay.frames import FrameStackReplayBuffer
from sb3_speedups.common.save_util import save_model, save_vecnormalize
from sb3_speedups.common.torch_utils import apply_num_threads
from sb3_speedups.errors import UserError
from sb3_speedups.zoo.evaluation import EVAL_SEED_OFFSET, evaluate, is_maskable
from sb3_speedups.registry import get_algo
from sb3_speedups.zoo import runs
from sb3_speedups.zoo.callbacks import AtomicCheckpointCallback, PrintEvaluation, SaveBestModelCallback, StopOnSignal
from sb3_speedups.zoo.envs import check_env_id, is_atari, make_env
from sb3_speedups.zoo.hyperparams import Hyperparams, preprocess_hyperparams, read_hyperparams
from sb3_speedups.zoo.validation import validate_model_kwargs


@dataclass
class TrainConfig:
    """
    Everything a training run needs (the CLI fills it; tests and the tuner build it directly).

    :param algo: RL-Zoo algorithm name
    :param env_id: gymnasium id
    :param n_timesteps: budget; ``-1`` takes the YAML's ``n_timesteps``
    :param seed: seed of the model and envs; ``None`` draws one (and records it in ``args.yml``)
    :param conf_file: YAML file instead of the bundled hyperparameters
    :param hyperparams: overrides of the YAML values (``-params``)
    :param log_folder: root of the run folders
    :param eval_freq: evaluate every this many env steps (all envs together); ``<= 0`` disables it
    :param eval_episodes: episodes per evaluation
    :param n_eval_envs: envs of the evaluation env
    :param save_freq: checkpoint every this many env steps; ``<= 0`` disables it
    :param vec_env: ``dummy``, ``subproc``, ...
    :param ray_address: Ray cluster of ``vec_env="ray"`` (``"auto"``, ``HOST:PORT``); ``None``: ``RAY_ADDRESS`` or a
        new local Ray
    :param device: torch device of the model
    :param tensorboard_log: tensorboard folder, ``""`` for none
    :param trained_agent: a saved model zip to continue training
    :param progress: show SB3's progress bar
    :param num_threads: torch threads, ``-1`` for the package default
    :param verbose: 0: where it saved and the final return; 1: also a line per periodic evaluation; 2: also SB3's
        logger tables (the model's ``verbose=1``)
    :param quiet: print nothing (overrides ``verbose``)
    :param stock: use the stock SB3 / sb3-contrib class even where ours exists
    """

    algo: str
    env_id: str
    n_timesteps: int = -1
    seed: int | None = None
    conf_file: str | None = None
    hyperparams: dict[str, Any] = field(default_factory=dict)
    log_folder: str = "logs"
    eval_freq: int = 25_000
    eval_episodes: int = 5
    n_eval_envs: int = 1
    save_freq: int = -1
    vec_env: str = "dummy"
    ray_address: str | None = None
    device: str = "auto"
    tensorboard_log: str = ""
    trained_agent: str = ""
    progress: bool = False
    num_threads: int = -1
    verbose: int = 1
    quiet: bool = False
    stock: bool = False

    @property
    def model_verbose(self) -> int:
        """:return: the ``verbose`` of the model: SB3's logger tables only from ``verbose=2`` on"""
        return 0 if self.quiet else max(self.verbose - 1, 0)

    def says(self, level: int) -> bool:
        """:return: whether messages of this level print (0: the end-of-run lines)"""
        return not self.quiet and self.verbose >= level


@dataclass
class TrainResult:
    """
    :param run_dir: the run folder
    :param model_path: the final model zip
    :param mean_return: mean return of the final evaluation
    :param std_return: its standard deviation
    :param interrupted: whether training was stopped by Ctrl-C / SIGTERM (the model was still saved)
    """

    run_dir: Path
    model_path: Path
    mean_return: float
    std_return: float
    interrupted: bool = False


@dataclass
class Experiment:
    """The prepared pieces of a run, before training."""

    config: TrainConfig
    algo_cls: type[BaseAlgorithm]
    raw_hyperparams: dict[str, Any]
    hyperparams: Hyperparams
    seed: int


def prepare_experiment(config: TrainConfig) -> Experiment:
    """
    Check the algorithm and env, read and validate the hyperparameters, fix the seed. Nothing is written.

    :param config: the run's settings
    :return: the prepared experiment
    """
    spec = get_algo(config.algo)
    check_env_id(config.env_id)
    algo_cls = spec.cls(stock=config.stock)
    raw = read_hyperparams(spec.name, config.env_id, config.conf_file, config.hyperparams, is_atari(config.env_id))
    hyperparams = preprocess_hyperparams(raw, config.n_timesteps)
    raw["n_timesteps"] = hyperparams.n_timesteps
    validate_model_kwargs(algo_cls, hyperparams.model_kwargs, spec.name)
    if "policy" not in hyperparams.model_kwargs:
        raise UserError(f"no policy for {config.env_id}: set 'policy: MlpPolicy' (or another) in the YAML section")
    seed = config.seed if config.seed is not None else int(np.random.randint(2**31 - 1))
    return Experiment(config, algo_cls, raw, hyperparams, seed)


def make_action_noise(hyperparams: Hyperparams, env: VecEnv) -> Any:
    """
    :return: the ``action_noise`` object for ``noise_type``/``noise_std`` (``normal`` or ``ornstein-uhlenbeck``)
    """
    if hyperparams.noise is None:
        return None
    noise_type, noise_std = hyperparams.noise
    if not isinstance(env.action_space, spaces.Box):
        raise UserError(f"noise_type needs a continuous (Box) action space, not {env.action_space}")
    n_actions = env.action_space.shape[0]
    kinds = {"normal": NormalActionNoise, "ornstein-uhlenbeck": OrnsteinUhlenbeckActionNoise}
    if noise_type not in kinds:
        raise UserError(f"unknown noise_type {noise_type!r}; choose one of: {', '.join(kinds)}")
    return kinds[noise_type](mean=np.zeros(n_actions), sigma=noise_std * np.ones(n_actions))


def check_model_file(path: str) -> Path:
    model_path = Path(path)
    if not model_path.is_file() or not zipfile.is_zipfile(model_path):
        raise UserError(f"cannot read model {path}: not an existing SB3 .zip file; check the path")
    return model_path


def stores_frames_once(experiment: Experiment, env: VecEnv) -> bool:
    """
    :return: whether our DQN or QR-DQN gets a :class:`FrameStackReplayBuffer` in place of SB3's default buffer:
        frame-stacked image observations (``frame_stack``, as in the Zoo's ``atari`` sections), no replay buffer
        class or ``optimize_memory_usage`` named. Its samples are stock's for a seed, in an eighth of the memory (the
        Zoo's 1M-transition QR-DQN buffer: 7.6 GB against stock's 56.5 GB, which fails to allocate on 24 GB).
    """
    kwargs = experiment.hyperparams.model_kwargs
    return (
        not experiment.config.stock
        and experiment.config.algo in ("dqn", "qrdqn")
        and int(experiment.hyperparams.frame_stack or 1) > 1
        and is_image_space(env.observation_space, check_channels=False)
        and kwargs.get("replay_buffer_class") is None
        and not kwargs.get("optimize_memory_usage", False)
    )


def create_model(experiment: Experiment, env: VecEnv) -> BaseAlgorithm:
    """
    Build the model (or load ``trained_agent`` to continue training it).

    :param experiment: the prepared experiment
    :param env: the training env
    :return: the model
    """
    config, kwargs = experiment.config, dict(experiment.hyperparams.model_kwargs)
    noise = make_action_noise(experiment.hyperparams, env)
    if noise is not None:
        kwargs["action_noise"] = noise
    if stores_frames_once(experiment, env):
        kwargs["replay_buffer_class"] = FrameStackReplayBuffer
    common: dict[str, Any] = {"seed": experiment.seed, "device": config.device, "verbose": config.model_verbose}
    if config.tensorboard_log:
        common["tensorboard_log"] = config.tensorboard_log
    try:
        if config.trained_agent:
            model_path = check_model_file(config.trained_agent)
            kwargs.pop("policy", None)
            kwargs.pop("policy_kwargs", None)
            return experiment.algo_cls.load(model_path, env=env, **common, **kwargs)
        return experiment.algo_cls(env=env, **common, **kwargs)
    except (AssertionError, ValueError, TypeError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"invalid hyperparameters for {config.algo} on {config.env_id}: {message}") from None


def eval_callback_class(algo_cls: type) -> type[EvalCallback]:
    """:return: ``EvalCallback``, or sb3-contrib's ``MaskableEvalCallback`` (evaluates with action masks) for MaskablePPO"""
    if is_maskable(algo_cls):
        from sb3_contrib.common.maskable.callbacks import MaskableEvalCallback

        return MaskableEvalCallback
    return EvalCallback


def make_callbacks(experiment: Experiment, run_dir: Path, eval_env: VecEnv | None) -> list[BaseCallback]:
    """
    :return: the YAML's callbacks, periodic evaluation (``best_model.zip``, ``evaluations.npz``) and checkpoints
    """
    config, n_envs = experiment.config, experiment.hyperparams.n_envs
    callbacks: list[BaseCallback] = [cls(**kwargs) for cls, kwargs in experiment.hyperparams.callbacks]
    if eval_env is not None:
        callbacks.append(
            eval_callback_class(experiment.algo_cls)(
                eval_env,
                n_eval_episodes=config.eval_episodes,
                eval_freq=max(config.eval_freq // n_envs, 1),
                log_path=str(run_dir),
                best_model_save_path=None,
                callback_on_new_best=SaveBestModelCallback(run_dir),
                callback_after_eval=PrintEvaluation() if config.says(1) else None,
                deterministic=True,
                verbose=config.model_verbose,
            )
        )
    if config.save_freq > 0:
        callbacks.append(AtomicCheckpointCallback(max(config.save_freq // n_envs, 1), run_dir, verbose=config.model_verbose))
    return callbacks


def save_run(model: BaseAlgorithm, run_dir: Path, env_id: str) -> Path:
    """Save the final model ``<env>.zip`` (and ``vecnormalize.pkl``) atomically into the run folder."""
    path = save_model(model, run_dir / f"{runs.run_name(env_id)}.zip")
    vec_normalize = model.get_vec_normalize_env()
    if isinstance(vec_normalize, VecNormalize):
        save_vecnormalize(vec_normalize, run_dir / runs.VECNORMALIZE_FILE)
    return path


def train(config: TrainConfig) -> TrainResult:
    """
    Run one training: evaluate periodically, save everything into a new run folder, evaluate at the end.
    Ctrl-C or SIGTERM stops training at the next environment step and still saves the model (a second one stops
    at once, through ``KeyboardInterrupt``).

    :param config: the run's settings
    :return: where it saved and the final evaluation
    """
    experiment = prepare_experiment(config)
    apply_num_threads(config.num_threads if config.num_threads > 0 else None)
    hp = experiment.hyperparams
    run_dir = runs.new_run_dir(config.log_folder, config.algo, config.env_id)
    runs.write_config(run_dir, config.env_id, experiment.raw_hyperparams)
    runs.write_yaml(run_dir / runs.ARGS_FILE, {**asdict(config), "seed": experiment.seed})

    normalize_stats = None
    if config.trained_agent:
        normalize_stats = Path(config.trained_agent).parent / runs.VECNORMALIZE_FILE
    vec_env_kwargs = {"address": config.ray_address} if config.ray_address is not None else None
    env = make_env(
        config.env_id, hp, hp.n_envs, experiment.seed, run_dir, config.vec_env, normalize_stats=normalize_stats,
        vec_env_kwargs=vec_env_kwargs,
    )  # fmt: skip
    eval_env = make_env(config.env_id, hp, config.n_eval_envs, experiment.seed + EVAL_SEED_OFFSET, eval_env=True)
    interrupted = False
    try:
        model = create_model(experiment, env)
        if config.says(1):
            print(
                f"Training {type(model).__module__}.{type(model).__name__} on {config.env_id} for {hp.n_timesteps} steps, "
                f"seed {experiment.seed}; saving into {run_dir}"
            )
        callbacks = make_callbacks(experiment, run_dir, eval_env if config.eval_freq > 0 else None)
        with StopOnSignal() as stop:
            try:
                model.learn(
                    hp.n_timesteps,
                    callback=[*callbacks, stop],
                    progress_bar=config.progress,
                    reset_num_timesteps=not config.trained_agent,
                )
            except KeyboardInterrupt:
                interrupted = True
            interrupted = interrupted or stop.requested
            if interrupted and not config.quiet:
                print(f"Interrupted: saving the model trained so far into {run_dir}", flush=True)
            model_path = save_run(model, run_dir, config.env_id)
        if interrupted:
            return TrainResult(run_dir, model_path, float("nan"), float("nan"), interrupted=True)
        sync_envs_normalization(env, eval_env)
        # seeded afresh: the final return does not depend on how many periodic evaluations ran (as in tune's trials)
        eval_env.seed(experiment.seed + EVAL_SEED_OFFSET)
        mean_return, std_return = evaluate(model, eval_env, config.eval_episodes, True)
    finally:
        _close_quietly(env)
        _close_quietly(eval_env)
    if config.says(0):
        print(f"Saved {model_path}")
        print(f"Final mean return over {config.eval_episodes} episodes: {mean_return:.2f} +/- {std_return:.2f}")
    return TrainResult(run_dir, model_path, float(mean_return), float(std_return))


def _close_quietly(env: VecEnv) -> None:
    try:
        env.close()
    except (OSError, EOFError, BrokenPipeError):
        pass  # workers already gone after Ctrl-C
