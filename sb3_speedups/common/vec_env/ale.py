"""
:class:`AleVecEnv`: ale-py's C++ ``AtariVectorEnv`` as an SB3 VecEnv that stands in for
``make_atari_env(env_id, n_envs, seed)`` + ``VecFrameStack(n_stack=4)``.

ALE steps the envs in C++ threads and does ``AtariWrapper``'s frame skip, max-pool, grayscale, resize, noop starts
and FIRE at reset, and the frame stack. On top of it, in Python: rewards clipped to their sign (true game returns in
``info["episode"]``, Monitor-style, at the end of each whole game), ``done`` on a life loss without a real reset, the
frame stack emptied at every ``done`` as ``VecFrameStack`` does, and SB3's auto-reset.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from stable_baselines3.common import atari_wrappers
from stable_baselines3.common.monitor import Monitor, ResultsWriter
from stable_baselines3.common.vec_env.base_vec_env import VecEnvIndices, VecEnvObs

from sb3_speedups.common.vec_env.adapters import VectorAdapter
from sb3_speedups.errors import MissingExtraError, UserError, UserTypeError, UserValueError

# The vector env's arguments (img_height, maxpool, life_loss_info, autoreset_mode) and partial resets
MIN_ALE_VERSION = (0, 12)
# ALE takes seeds as C ints: SB3's seeds (up to 2**32 + n_envs) are folded into [0, 2**31).
SEED_MODULUS = 2**31
# AtariEnv arguments of an env id's registration (or env_kwargs) that ALE's vector env can honour.
ENV_KWARGS = ("repeat_action_probability", "full_action_space", "frameskip", "max_num_frames_per_episode", "obs_type")


@dataclass(frozen=True)
class AtariGame:
    """
    What an env id asks of ALE: the ROM and the ``AtariEnv`` settings of its registration.

    :param game: ALE's ROM name (``breakout``)
    :param frameskip: frames per step of the registered env (1 for ``NoFrameskip-v4``, 4 for ``v5``)
    :param repeat_action_probability: ALE's sticky actions (0 for ``v4``, 0.25 for ``v5``)
    :param full_action_space: whether all 18 actions are legal
    :param max_frames: frames after which a game is truncated
    """

    game: str
    frameskip: int
    repeat_action_probability: float
    full_action_space: bool
    max_frames: int


def atari_game(env_id: str, env_kwargs: dict[str, Any] | None = None) -> AtariGame:
    """
    :param env_id: an ALE env id, such as ``BreakoutNoFrameskip-v4`` or ``ALE/Breakout-v5``
    :param env_kwargs: ``AtariEnv`` arguments that replace the registered ones
    :return: the game and its settings
    """
    import ale_py

    gym.register_envs(ale_py)
    spec = gym.registry.get(env_id)
    if spec is None or "AtariEnv" not in str(spec.entry_point):
        raise UserValueError(f"ALE cannot run {env_id!r}; give an Atari id such as BreakoutNoFrameskip-v4 or ALE/Breakout-v5")
    unknown = sorted(set(env_kwargs or {}) - {*ENV_KWARGS, "render_mode"})
    if unknown:
        raise UserTypeError(f"ALE's vector env does not take env_kwargs {unknown}; use only {', '.join(ENV_KWARGS)}")
    kwargs = {**spec.kwargs, **(env_kwargs or {})}
    if kwargs.get("obs_type", "rgb") != "rgb" or kwargs.get("render_mode") is not None:
        raise UserValueError(f"ALE's vector env makes its own grayscale frames; drop obs_type/render_mode for {env_id}")
    frameskip = kwargs.get("frameskip", 1)
    if isinstance(frameskip, bool) or not isinstance(frameskip, int) or frameskip < 1:
        raise UserValueError(f"{env_id} skips a random number of frames; use the NoFrameskip-v4 or v5 id of the game")
    max_frames = kwargs.get("max_num_frames_per_episode") or np.iinfo(np.int32).max
    if spec.max_episode_steps is not None:
        max_frames = min(max_frames, spec.max_episode_steps * frameskip)
    return AtariGame(
        game=kwargs["game"],
        frameskip=frameskip,
        repeat_action_probability=float(kwargs.get("repeat_action_probability", 0.0)),
        full_action_space=bool(kwargs.get("full_action_space", False)),
        max_frames=int(max_frames),
    )


@dataclass
class GameState:
    """
    Per-env bookkeeping of what ALE does not do: lives, true returns, the stack since a life loss, the FIRE after it.

    :param lives: lives after the last step
    :param returns: unclipped return of the game so far
    :param stack_age: frames in the stack since the last life loss (``n_stack`` and more: none to empty)
    :param fire_next: the next action is FIRE (a life was lost in a game that needs FIRE to go on)
    :param game_over: the last step ended the game (a real reset follows)
    """

    lives: np.ndarray
    returns: np.ndarray
    stack_age: np.ndarray
    fire_next: np.ndarray
    game_over: np.ndarray


class AleVecEnv(VectorAdapter):
    """
    ale-py's ``AtariVectorEnv`` as an SB3 VecEnv with what ``make_atari_env`` + ``VecFrameStack`` give: uint8
    channel-first stacks of ``n_stack`` grayscale frames (no ``VecTransposeImage`` needed), sign-clipped rewards,
    ``done`` on a life loss, Monitor's ``info["episode"]`` at each game's end, SB3's auto-reset and seeding.

    ALE cannot step one env of the batch alone, so after a life loss in a game with FIRE the env's next action is
    replaced by FIRE (that step is returned as usual), where SB3's ``FireResetEnv`` presses FIRE and action 2 in hidden
    steps. Other differences from the Python wrappers are listed in ``docs/architecture.md``.

    :param env_id: an ALE id: ``BreakoutNoFrameskip-v4``, ``ALE/Breakout-v5``; its registration sets sticky actions,
        the action set and the frame limit. A step lasts the id's ``frameskip`` times ``frame_skip`` frames, as in
        ``make_atari_env`` (so 16 for ``v5`` ids unless ``env_kwargs={"frameskip": 1}``).
    :param n_envs: number of envs
    :param seed: base seed (env ``i`` gets ``seed + i``), applied at the first ``reset``
    :param n_stack: frames per observation (``VecFrameStack``'s ``n_stack``)
    :param noop_max: at most this many no-op frames at a game's start (``AtariWrapper``'s)
    :param frame_skip: frames per step (``AtariWrapper``'s; max-pooled over the last two when above 1)
    :param screen_size: observations are ``screen_size`` x ``screen_size`` frames
    :param terminal_on_life_loss: ``done`` when a life is lost (the game goes on)
    :param clip_reward: rewards clipped to their sign (``info["episode"]`` keeps the true return)
    :param action_repeat_probability: ``AtariWrapper``'s sticky actions, for ids registered without them
    :param env_kwargs: ``AtariEnv`` settings that replace the registered ones (``repeat_action_probability``,
        ``full_action_space``, ``frameskip``, ``max_num_frames_per_episode``)
    :param num_threads: ALE's C++ threads; ``None``: one per CPU core, at most ``n_envs``
    :param monitor_file: Monitor CSV file of the finished games (SB3's ``ResultsWriter``), or ``None``
    :param info_keywords: info keys copied into ``info["episode"]`` (Monitor's ``info_keywords``)
    """

    def __init__(
        self,
        env_id: str,
        n_envs: int = 1,
        seed: int | None = None,
        *,
        n_stack: int = 4,
        noop_max: int = 30,
        frame_skip: int = 4,
        screen_size: int = 84,
        terminal_on_life_loss: bool = True,
        clip_reward: bool = True,
        action_repeat_probability: float = 0.0,
        env_kwargs: dict[str, Any] | None = None,
        num_threads: int | None = None,
        monitor_file: str | None = None,
        info_keywords: tuple[str, ...] = (),
    ) -> None:
        try:
            import ale_py
            from ale_py.vector_env import AtariVectorEnv
        except ImportError:
            raise MissingExtraError(
                "AleVecEnv needs ale-py >= 0.12; pip install 'sb3-speedups[atari]' 'ale-py>=0.12'"
            ) from None
        if tuple(int(part) for part in ale_py.__version__.split(".")[:2]) < MIN_ALE_VERSION:
            raise MissingExtraError(f"AleVecEnv needs ale-py >= 0.12, not {ale_py.__version__}; pip install 'ale-py>=0.12'")
        for name, value in (("n_envs", n_envs), ("n_stack", n_stack), ("frame_skip", frame_skip)):
            if value < 1:
                raise UserValueError(f"{name} must be at least 1, got {value}")
        game = atari_game(env_id, env_kwargs)
        if action_repeat_probability > 0 and game.repeat_action_probability > 0:
            raise UserValueError(f"{env_id} already has sticky actions; drop action_repeat_probability")
        self._vector_env = AtariVectorEnv(
            game.game,
            n_envs,
            num_threads=0 if num_threads is None else num_threads,
            max_num_frames_per_episode=game.max_frames,
            repeat_action_probability=max(game.repeat_action_probability, action_repeat_probability),
            full_action_space=game.full_action_space,
            img_height=screen_size,
            img_width=screen_size,
            stack_num=n_stack,
            frameskip=game.frameskip * frame_skip,
            maxpool=frame_skip > 1,
            noop_max=noop_max,
            reward_clipping=False,
        )
        self.env_id, self.n_stack = env_id, n_stack
        self._frameskip = game.frameskip
        self._terminal_on_life_loss, self._clip_reward = terminal_on_life_loss, clip_reward
        action_set = list(self._vector_env.ale.get_action_set())
        self._action_meanings = [action.name for action in action_set]
        self._fire_action = self._action_meanings.index("FIRE") if "FIRE" in self._action_meanings else None
        self._wrappers = self._applied_wrappers(noop_max, frame_skip, action_repeat_probability)
        self._state = GameState(
            lives=np.zeros(n_envs, dtype=np.int32),
            returns=np.zeros(n_envs),
            stack_age=np.full(n_envs, n_stack),
            fire_next=np.zeros(n_envs, dtype=bool),
            game_over=np.zeros(n_envs, dtype=bool),
        )
        self._last_obs = np.zeros((n_envs, n_stack, screen_size, screen_size), dtype=np.uint8)
        self._t_start = time.time()
        self._info_keywords = tuple(info_keywords)
        self._writer = (
            ResultsWriter(monitor_file, header={"t_start": self._t_start, "env_id": env_id}, extra_keys=self._info_keywords)
            if monitor_file is not None
            else None
        )
        observation_space = spaces.Box(0, 255, (n_stack, screen_size, screen_size), dtype=np.uint8)
        super().__init__(n_envs, observation_space, spaces.Discrete(len(action_set)))
        if seed is not None:
            self.seed(seed)

    @classmethod
    def from_env_id(
        cls, env_id: str, n_envs: int, seed: int | None = None, env_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> AleVecEnv:
        return cls(env_id, n_envs, seed=seed, env_kwargs=env_kwargs, **kwargs)

    def _applied_wrappers(self, noop_max: int, frame_skip: int, action_repeat_probability: float) -> list[type]:
        """The gym wrappers whose work this env does (what ``env_is_wrapped`` answers for)."""
        wrappers: list[type] = [Monitor, atari_wrappers.AtariWrapper, atari_wrappers.WarpFrame]
        optional = {
            atari_wrappers.StickyActionEnv: action_repeat_probability > 0,
            atari_wrappers.NoopResetEnv: noop_max > 0,
            atari_wrappers.MaxAndSkipEnv: frame_skip > 1,
            atari_wrappers.EpisodicLifeEnv: self._terminal_on_life_loss,
            atari_wrappers.FireResetEnv: self._fire_action is not None,
            atari_wrappers.ClipRewardEnv: self._clip_reward,
        }
        return wrappers + [wrapper for wrapper, applied in optional.items() if applied]

    def _step_batch(self, actions: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        state = self._state
        actions = np.asarray(actions).astype(np.int64, copy=False).reshape(self.num_envs)
        if self._fire_action is not None and state.fire_next.any():
            actions = np.where(state.fire_next, self._fire_action, actions)
            state.fire_next[:] = False
        obs, rewards, terminated, truncated, ale_info = self._vector_env.step(actions)
        lives = ale_info["lives"]
        state.returns += rewards
        # EpisodicLifeEnv's test: lives may sit at 0 for a few frames before the game is over (Qbert)
        life_lost = (lives < state.lives) & (lives > 0) if self._terminal_on_life_loss else np.zeros_like(terminated)
        state.lives = lives
        state.game_over = terminated | truncated
        self._empty_old_frames(obs)
        infos = [
            {"lives": lives_i, "episode_frame_number": episode_frame, "frame_number": frame}
            for lives_i, episode_frame, frame in zip(
                lives.tolist(), ale_info["episode_frame_number"].tolist(), ale_info["frame_number"].tolist(), strict=True
            )
        ]
        for index in np.flatnonzero(state.game_over).tolist():
            infos[index]["episode"] = self._end_game(index, infos[index])
        self._last_obs = obs
        clipped = np.sign(rewards) if self._clip_reward else rewards
        return obs, clipped, terminated | life_lost, truncated, infos

    def _empty_old_frames(self, obs: np.ndarray) -> None:
        """ALE keeps its stack across a life loss; VecFrameStack starts from zeros at every ``done``."""
        age = self._state.stack_age
        age += 1
        for index in np.flatnonzero(age < self.n_stack).tolist():
            obs[index, : self.n_stack - age[index]] = 0

    def _end_game(self, index: int, info: dict[str, Any]) -> dict[str, Any]:
        """:return: Monitor's episode info of env ``index``'s game (its length in steps of the registered env)"""
        episode = {
            "r": round(float(self._state.returns[index]), 6),
            "l": -(-info["episode_frame_number"] // self._frameskip),
            "t": round(time.time() - self._t_start, 6),
        }
        for key in self._info_keywords:
            episode[key] = info[key]
        if self._writer is not None:
            self._writer.write_row(episode)
        return episode

    def _reset_some(self, indices: np.ndarray) -> tuple[Any, list[dict[str, Any]]]:
        state = self._state
        over = state.game_over[indices]
        reset_obs = self._last_obs[indices]
        reset_infos: list[dict[str, Any]] = [{} for _ in indices]
        if over.any():
            mask = np.zeros(self.num_envs, dtype=bool)
            mask[indices[over]] = True
            obs, ale_info = self._vector_env.reset(options={"reset_mask": mask})
            reset_obs[over] = obs[mask]
            self._start_games(mask, ale_info["lives"])
            for position in np.flatnonzero(over).tolist():
                reset_infos[position] = self._reset_info(ale_info, int(indices[position]))
        lost = indices[~over]
        if lost.size:
            # the game goes on: only the stack starts again, from the last frame (as VecFrameStack after a done)
            reset_obs[~over, :-1] = 0
            state.stack_age[lost] = 1
            state.fire_next[lost] = self._fire_action is not None
        return reset_obs, reset_infos

    def _reset_info(self, ale_info: dict[str, np.ndarray], index: int) -> dict[str, Any]:
        """FireResetEnv returns an empty reset info; without it the info is AtariEnv's."""
        if self._fire_action is not None:
            return {}
        return {key: int(ale_info[key][index]) for key in ("lives", "episode_frame_number", "frame_number")}

    def _start_games(self, mask: np.ndarray, lives: np.ndarray) -> None:
        state = self._state
        state.lives[mask] = lives[mask]
        state.returns[mask] = 0.0
        state.stack_age[mask] = self.n_stack
        state.fire_next[mask] = False
        state.game_over[mask] = False

    def reset(self) -> VecEnvObs:
        if self._options_for_all():
            raise UserValueError("AleVecEnv takes no reset options; call set_options(None)")
        seeds = [seed for seed in self._seeds if seed is not None]
        seed = np.array(seeds) % SEED_MODULUS if len(seeds) == self.num_envs else None
        obs, ale_info = self._vector_env.reset(seed=seed)
        self._start_games(np.ones(self.num_envs, dtype=bool), ale_info["lives"])
        self._last_obs = obs
        self.reset_infos = [self._reset_info(ale_info, index) for index in range(self.num_envs)]
        self._reset_seeds()
        self._reset_options()
        return obs

    def close(self) -> None:
        # ALE's threads end when the vector env is freed, not when it is closed
        vector_env = self.__dict__.pop("_vector_env", None)
        if vector_env is not None:
            vector_env.close()
        if self._writer is not None:
            self._writer.close()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        values = {"render_mode": None, "spec": gym.spec(self.env_id)}
        if attr_name not in values:
            raise AttributeError(f"AleVecEnv's envs run in C++ and have no attribute {attr_name!r}; only {sorted(values)}")
        return [values[attr_name] for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        raise UserError("AleVecEnv's envs run in C++ and have no Python attributes to set; pass settings to AleVecEnv()")

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **method_kwargs) -> list[Any]:
        if method_name != "get_action_meanings":
            raise AttributeError(f"AleVecEnv's envs run in C++; of their methods only get_action_meanings: {method_name!r}")
        return [list(self._action_meanings) for _ in self._get_indices(indices)]

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        wrapped = any(issubclass(wrapper, wrapper_class) for wrapper in self._wrappers)
        return [wrapped for _ in self._get_indices(indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [None for _ in range(self.num_envs)]
