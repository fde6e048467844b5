"""
DQN as in Stable-Baselines3, faster, with modern replay options. What differs from stock, and why it is faster, is
the Q-learning engine that QR-DQN shares (:mod:`sb3_speedups.dqn.q_learning`): all minibatches of a ``train()``
sampled at once, one target forward, the hand-derived Huber TD step (:class:`~sb3_speedups.dqn.update.HandDerivedQUpdate`)
or the autograd one, the lean collection loop acting from plain tensors. This module adds DQN's options.

Options, off by default so that the defaults are stock SB3 DQN: ``double_q``, ``combined_replay``, dueling heads
(``policy_kwargs=dict(dueling=True)``), and prioritised replay (any ``replay_buffer_class`` with ``update_priorities``,
e.g. :class:`sb3_speedups.dqn.replay.buffers.PrioritizedReplayBuffer`); n-step returns as stock (``n_steps``).
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import stable_baselines3

from sb3_speedups.common.replay.sampling import batched_sampling_supported
from sb3_speedups.dqn.policies import DUELING_POLICIES
from sb3_speedups.dqn.q_learning import FastQLearning, is_prioritized
from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer
from sb3_speedups.common.replay.frames import FrameStackReplayBuffer
from sb3_speedups.errors import UserValueError

# Buffers that compute n-step returns themselves (given n_steps and gamma), where SB3 would ignore n_steps
_N_STEP_BUFFERS = (PrioritizedReplayBuffer, FrameStackReplayBuffer)

SelfDQN = TypeVar("SelfDQN", bound="DQN")


class DQN(FastQLearning, stable_baselines3.DQN):
    """
    Deep Q-Network, a drop-in for :class:`stable_baselines3.DQN` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`stable_baselines3.DQN` for every argument not listed here. ``policy_kwargs`` may hold
    ``dueling=True`` for dueling heads (:mod:`sb3_speedups.dqn.policies`).

    :param double_q: Double DQN targets (van Hasselt et al. 2016): the online network picks the next action, the
        target network values it
    :param combined_replay: combined experience replay (Zhang & Sutton 2017): the newest transition of every env is
        part of every minibatch (needs the stock ``ReplayBuffer``)
    :param per_final_beta: with a prioritised replay buffer (one with ``update_priorities`` and ``beta``), its
        ``beta`` goes linearly from its initial value to this over training
    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param fast_update: use the hand-derived update for MLP Q-networks (``False`` forces the autograd update)
    """

    #: ``policy_kwargs`` keys this class reads beyond the policy's own arguments (for the tuner's checks)
    extra_policy_kwargs: ClassVar[frozenset[str]] = frozenset({"dueling"})

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        double_q: bool = False,
        combined_replay: bool = False,
        per_final_beta: float = 1.0,
        num_threads: int | None = None,
        fast_update: bool = True,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        policy_kwargs = dict(kwargs.pop("policy_kwargs", None) or {})
        dueling = policy_kwargs.pop("dueling", False)
        if dueling:
            if isinstance(policy, str):
                if policy not in DUELING_POLICIES:
                    raise UserValueError(
                        f"dueling=True is not available for policy {policy!r}: use one of {list(DUELING_POLICIES)}"
                    )
                policy = DUELING_POLICIES[policy]
            policy_kwargs["dueling"] = True
        n_steps = int(kwargs.pop("n_steps", 1))
        buffer_class = kwargs.get("replay_buffer_class")
        if n_steps > 1 and isinstance(buffer_class, type) and issubclass(buffer_class, _N_STEP_BUFFERS):
            # SB3 only wires n_steps into its own NStepReplayBuffer; ours compute the same returns.
            buffer_kwargs = dict(kwargs.get("replay_buffer_kwargs") or {})
            buffer_kwargs.setdefault("n_steps", n_steps)
            buffer_kwargs.setdefault("gamma", kwargs.get("gamma", 0.99))
            kwargs["replay_buffer_kwargs"] = buffer_kwargs
            super().__init__(policy, env, policy_kwargs=policy_kwargs or None, _init_setup_model=False, **kwargs)
            self.n_steps = n_steps
        else:
            super().__init__(
                policy, env, policy_kwargs=policy_kwargs or None, n_steps=n_steps, _init_setup_model=False, **kwargs
            )
        if not 0.0 <= per_final_beta <= 1.0:
            raise UserValueError(f"per_final_beta={per_final_beta} is invalid: use a value in [0, 1]")
        self.double_q = double_q
        self.combined_replay = combined_replay
        self.per_final_beta = per_final_beta
        self.num_threads = num_threads
        self.fast_update = fast_update
        self._per_initial_beta: float | None = None
        self._speedups = None
        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        n_steps = self.n_steps
        if isinstance(self.replay_buffer_class, type) and issubclass(self.replay_buffer_class, _N_STEP_BUFFERS):
            self.n_steps = 1  # the buffer has them (see __init__); SB3 would warn that they are ignored
        try:
            super()._setup_model()
        finally:
            self.n_steps = n_steps
        if (
            self.combined_replay
            and not is_prioritized(self.replay_buffer)
            and not batched_sampling_supported(self.replay_buffer)
        ):
            raise UserValueError(
                f"combined_replay=True needs one-step transitions from the stock ReplayBuffer or a FrameStackReplayBuffer, "
                f"not {type(self.replay_buffer).__name__}: drop replay_buffer_class, n_steps or combined_replay"
            )
