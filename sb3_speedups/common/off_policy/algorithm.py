"""
What our SAC and TD3 (and through TD3, DDPG) share around their gradient steps: the extra arguments, the speed-only
state and when it is rebuilt, what is left out of saved files. Each algorithm supplies its update
(:meth:`FastOffPolicyAlgorithm._make_updater`) and the check of its hand-derived path
(:meth:`FastOffPolicyAlgorithm._unsupported_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sb3_speedups.common.fast_model import FastModel
from sb3_speedups.common.acting.off_policy import FrozenActorSampling, FrozenOffPolicyActor
from sb3_speedups.common.off_policy.collection import FastOffPolicyCollection
from sb3_speedups.common.off_policy.training import check_tau, largest_linear


@dataclass
class OffPolicySpeedups:
    """Speed-only state, rebuilt when the policy or its optimizer state is replaced (never saved)."""

    #: the gradient step: hand-derived, or the autograd fallback (both have ``policy`` and ``is_bound()``)
    updater: Any
    fallback_reason: str | None
    #: inputs x outputs of the largest ``Linear`` layer (for the update's thread count)
    largest_linear: int
    #: the actor's frozen copy that acts during collection (with the hand-derived update), else ``None``
    actor: FrozenOffPolicyActor | None


class FastOffPolicyAlgorithm(FastModel, FrozenActorSampling, FastOffPolicyCollection):
    """
    Mixin, first among the bases of our actor-critic off-policy classes (``class TD3(FastOffPolicyAlgorithm,
    stable_baselines3.TD3)``).

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces the autograd update)
    """

    _speedups: OffPolicySpeedups | None
    actor: Any
    critic: Any

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        num_threads: int | None = None,
        fast_update: bool = True,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        self._check_arguments(kwargs)
        super().__init__(policy, env, _init_setup_model=False, **kwargs)  # type: ignore[call-arg]
        self.num_threads = num_threads
        self.fast_update = fast_update
        self._speedups = None
        if _init_setup_model:
            self._setup_model()

    def _check_arguments(self, kwargs: dict[str, Any]) -> None:
        """Refuse bad arguments in one line before stock's constructor runs (stock checks fewer)."""
        check_tau(kwargs.get("tau", 0.005))

    def _make_updater(self, reason: str | None) -> Any:
        """:return: the hand-derived update when ``reason`` is ``None``, else the autograd one"""
        raise NotImplementedError

    def _make_frozen_actor(self, reason: str | None) -> FrozenOffPolicyActor | None:
        """:return: the copy that acts during collection (with the hand-derived update), ``None`` for stock's acting"""
        return FrozenOffPolicyActor(self.actor) if reason is None else None

    def _ensure_speedups(self) -> OffPolicySpeedups:
        speed = self._speedups
        if speed is not None and speed.updater.policy is self.policy and speed.updater.is_bound():
            return speed
        reason = self.fast_path_unsupported_reason()
        updater = self._make_updater(reason)
        if reason is not None and self.verbose >= 1:
            print(f"sb3_speedups {type(self).__name__}: using the autograd update ({reason})")
        actor = self._make_frozen_actor(reason)
        self._speedups = OffPolicySpeedups(updater, reason, largest_linear(self.actor, self.critic), actor)
        return self._speedups
