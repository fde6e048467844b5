"""
QR-DQN as in sb3-contrib, faster: our DQN's Q-learning engine (:class:`~sb3_speedups.dqn.q_learning.FastQLearning`)
with QR-DQN's quantile head (:class:`~sb3_speedups.qrdqn.head.QuantileHead`). What differs from stock, and why it is
faster, is the engine's: all minibatches of a ``train()`` sampled at once with stock's RNG draws, one forward of the
target network for all their targets, each gradient step hand-derived on flat parameters with one fused Adam call
(autograd with stock's loss for CNN, ``Dict`` observations and custom networks or optimizers), the loss read once per
``train()``, and the lean collection loop acting from plain tensors.
"""

from __future__ import annotations

from typing import Any

import sb3_contrib

from sb3_speedups.dqn.q_learning import FastQLearning, is_prioritized
from sb3_speedups.dqn.update import QHead
from sb3_speedups.errors import UserValueError
from sb3_speedups.qrdqn.head import QuantileHead


class QRDQN(FastQLearning, sb3_contrib.QRDQN):
    """
    Quantile Regression DQN, a drop-in for :class:`sb3_contrib.QRDQN` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`sb3_contrib.QRDQN` for every argument not listed here.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param fast_update: use the hand-derived update for MLP quantile networks (``False`` forces the autograd update)
    """

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
        super().__init__(policy, env, _init_setup_model=False, **kwargs)
        self.num_threads = num_threads
        self.fast_update = fast_update
        self._speedups = None
        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        super()._setup_model()
        if is_prioritized(self.replay_buffer):
            # QR-DQN's loss has no per-sample TD error to prioritise by (stock would sample it and never update it)
            raise UserValueError("QRDQN does not support prioritised replay: drop replay_buffer_class")

    def _q_head(self) -> QHead:
        return QuantileHead(self.policy.n_quantiles, int(self.action_space.n))  # type: ignore[attr-defined]
