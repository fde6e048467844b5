"""
A policy's ``set_training_mode`` without ``nn.Module.train``'s recursive walk and ``__setattr__`` checks.

Every algorithm switches the policy to evaluation mode before every collection and back before every ``train()``;
where a collection is a few env steps (off-policy algorithms, A2C), the walk is a visible share of the cycle.
:class:`TrainingModeSwitch` finds once which modules the policy's own ``set_training_mode`` sets, then sets exactly
those flags; :class:`FastTrainingMode` keeps one on the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stable_baselines3.common.base_class import BaseAlgorithm
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


class FastTrainingMode(BaseAlgorithm):
    """
    Mixin for subclasses of a stock algorithm: :meth:`_set_training_mode` is ``self.policy.set_training_mode`` through
    a :class:`TrainingModeSwitch` kept until the policy is replaced or the next ``learn()`` (its modules may have
    changed in between); the switch is not saved.
    """

    _training_mode_switch: TrainingModeSwitch | None = None

    def _set_training_mode(self, mode: bool) -> None:
        """``self.policy.set_training_mode(mode)``, cheaper (for ``train()`` overrides too)"""
        switch = self._training_mode_switch
        if switch is None or switch.policy is not self.policy:
            switch = self._training_mode_switch = TrainingModeSwitch(self.policy)
        switch(mode)

    def _setup_learn(self, *args: Any, **kwargs: Any) -> Any:
        self._training_mode_switch = None
        return super()._setup_learn(*args, **kwargs)

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_training_mode_switch"]


def set_training_mode(model: BaseAlgorithm, mode: bool) -> None:
    """``model.policy.set_training_mode(mode)``, through the model's kept switch where it is a :class:`FastTrainingMode`"""
    if isinstance(model, FastTrainingMode):
        model._set_training_mode(mode)
    else:
        model.policy.set_training_mode(mode)
