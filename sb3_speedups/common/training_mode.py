"""
A policy's ``set_training_mode`` without ``nn.Module.train``'s recursive walk and ``__setattr__`` checks.

Off-policy algorithms switch the policy to evaluation mode before every collection and back before every ``train()``,
so at one gradient step every few env steps the walk is a visible share of the step. :class:`TrainingModeSwitch`
finds once which modules the policy's own ``set_training_mode`` sets, then sets exactly those flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stable_baselines3.common.policies import BaseModel
from stable_baselines3.dqn.policies import DQNPolicy
from stable_baselines3.sac.policies import SACPolicy
from stable_baselines3.td3.policies import TD3Policy
from torch import nn

#: ``set_training_mode`` methods that only call ``nn.Module.train`` on some modules and set ``policy.training``
PLAIN_SET_TRAINING_MODES: set[Callable[..., Any]] = {
    BaseModel.set_training_mode,
    DQNPolicy.set_training_mode,
    SACPolicy.set_training_mode,
    TD3Policy.set_training_mode,
}


class TrainingModeSwitch:
    """
    Sets a policy's training mode as its ``set_training_mode`` does (for the methods in
    :data:`PLAIN_SET_TRAINING_MODES` on modules that do not override ``train``), else calls it.

    :param policy: the policy
    """

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy
        self.modules: list[nn.Module] | None = self._touched_modules(policy)

    @staticmethod
    def _touched_modules(policy: nn.Module) -> list[nn.Module] | None:
        """:return: the modules whose ``training`` flag ``policy.set_training_mode`` sets, or ``None`` if unknown"""
        if getattr(type(policy), "set_training_mode", None) not in PLAIN_SET_TRAINING_MODES:
            return None
        modules = list(policy.modules())
        if any(type(m).train is not nn.Module.train for m in modules):
            return None
        saved = [m.training for m in modules]
        try:
            for m in modules:
                object.__setattr__(m, "training", False)
            policy.set_training_mode(True)  # type: ignore[operator]
            return [m for m in modules if m.training]
        finally:
            for m, flag in zip(modules, saved, strict=True):
                object.__setattr__(m, "training", flag)

    def __call__(self, mode: bool) -> None:
        """Put the policy in training (``True``) or evaluation mode, as ``policy.set_training_mode(mode)`` does."""
        if self.modules is None:
            self.policy.set_training_mode(mode)  # type: ignore[operator]
            return
        for m in self.modules:
            object.__setattr__(m, "training", mode)
