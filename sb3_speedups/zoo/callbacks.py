"""Callbacks of a training run: saves (all atomic) and a clean stop on Ctrl-C / SIGTERM."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
from stable_baselines3.common.vec_env import VecNormalize

from sb3_speedups.common.save_util import save_model, save_vecnormalize


class SaveBestModelCallback(BaseCallback):
    """
    Child of ``EvalCallback`` (``callback_on_new_best``): saves ``best_model.zip`` (and the VecNormalize statistics
    next to it) atomically whenever the evaluation return improves.

    :param save_dir: the run folder
    """

    def __init__(self, save_dir: str | Path) -> None:
        super().__init__()
        self.save_dir = Path(save_dir)

    def _on_step(self) -> bool:
        save_model(self.model, self.save_dir / "best_model.zip")
        vec_normalize = self.model.get_vec_normalize_env()
        if isinstance(vec_normalize, VecNormalize):
            save_vecnormalize(vec_normalize, self.save_dir / "best_vecnormalize.pkl")
        return True


class PrintEvaluation(BaseCallback):
    """
    Child of ``EvalCallback`` (``callback_after_eval``): one line per periodic evaluation, instead of SB3's
    three (which come with its logger tables at ``verbose=2``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.best = -np.inf

    def _on_step(self) -> bool:
        evaluation = self.parent
        assert isinstance(evaluation, EvalCallback)
        mean = evaluation.last_mean_reward
        returns = evaluation.evaluations_results[-1] if evaluation.evaluations_results else [mean]
        new_best = evaluation.best_mean_reward > self.best
        self.best = max(self.best, evaluation.best_mean_reward)
        print(
            f"Evaluation at {self.num_timesteps} steps: mean return {mean:.2f} +/- {np.std(returns):.2f}"
            + (" (new best: saved best_model.zip)" if new_best and evaluation.callback_on_new_best is not None else ""),
            flush=True,
        )
        return True


class AtomicCheckpointCallback(BaseCallback):
    """
    Save ``rl_model_<steps>_steps.zip`` every ``save_freq`` calls (vectorised steps), atomically.

    :param save_freq: period in calls of the callback
    :param save_dir: folder of the checkpoints
    """

    def __init__(self, save_freq: int, save_dir: str | Path, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.save_freq = save_freq
        self.save_dir = Path(save_dir)

    def _on_step(self) -> bool:
        if self.n_calls % self.save_freq == 0:
            path = save_model(self.model, self.save_dir / f"rl_model_{self.num_timesteps}_steps.zip")
            vec_normalize = self.model.get_vec_normalize_env()
            if isinstance(vec_normalize, VecNormalize):
                save_vecnormalize(vec_normalize, self.save_dir / f"rl_model_vecnormalize_{self.num_timesteps}_steps.pkl")
            if self.verbose > 1:
                print(f"Saving model checkpoint to {path}")
        return True


class StopOnSignal(BaseCallback):
    """
    Ends ``learn()`` at the next environment step once Ctrl-C (SIGINT) or SIGTERM arrived, so that the model is
    saved from a consistent state: a ``KeyboardInterrupt`` raised at an arbitrary point can land inside a vec env's
    step or a worker handshake and leave it unusable. A second signal raises ``KeyboardInterrupt`` at once, for a
    user who does not want to wait for the current update to finish.

    Use as a context manager around ``learn()``: it installs the handlers (main thread only) and restores the
    previous ones on exit.

    :param signals: the signals that request the stop
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        super().__init__()
        self.signals = signals
        self.requested = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _on_step(self) -> bool:
        return not self.requested
