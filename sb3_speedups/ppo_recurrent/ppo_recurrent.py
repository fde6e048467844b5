"""
RecurrentPPO as in sb3-contrib, faster. What differs from stock, and why it is faster:

- the policies (:mod:`sb3_speedups.ppo_recurrent.policies`) run each padded training sequence through one
  LSTM/GRU call instead of sb3-contrib's Python loop over time steps whenever an episode starts in a sequence;
- GRU policies (``MlpGruPolicy``, ... or ``policy_kwargs=dict(rnn_type="gru")``) are available;
- torch runs on one CPU thread unless the user chose otherwise (faster and steadier for small networks).

LSTM models are saved with sb3-contrib's policy classes, so stock sb3-contrib loads them; files saved by
sb3-contrib load here with the fast policies.
"""

from __future__ import annotations

from typing import Any, ClassVar

import sb3_contrib
from stable_baselines3.common.policies import BasePolicy

from sb3_speedups.common.torch_utils import apply_num_threads
from sb3_speedups.ppo_recurrent.policies import (
    FAST_POLICIES,
    CnnGruPolicy,
    CnnLstmPolicy,
    MlpGruPolicy,
    MlpLstmPolicy,
    MultiInputGruPolicy,
    MultiInputLstmPolicy,
)


class RecurrentPPO(sb3_contrib.RecurrentPPO):
    """
    Recurrent PPO, a drop-in for :class:`sb3_contrib.RecurrentPPO` (same arguments, ``learn``, ``predict`` with
    ``state``/``episode_start``, saved files); see :class:`sb3_contrib.RecurrentPPO` for every other argument.

    :param num_threads: torch intra-op threads; ``None``: 1 unless the user already chose a number
    """

    policy_aliases: ClassVar[dict[str, type[BasePolicy]]] = {
        "MlpLstmPolicy": MlpLstmPolicy,
        "CnnLstmPolicy": CnnLstmPolicy,
        "MultiInputLstmPolicy": MultiInputLstmPolicy,
        "MlpGruPolicy": MlpGruPolicy,
        "CnnGruPolicy": CnnGruPolicy,
        "MultiInputGruPolicy": MultiInputGruPolicy,
    }

    def __init__(self, *args: Any, num_threads: int | None = None, **kwargs: Any) -> None:
        self.num_threads = num_threads
        super().__init__(*args, **kwargs)

    def _setup_model(self) -> None:
        apply_num_threads(self.num_threads)
        self.policy_class = FAST_POLICIES.get(self.policy_class, self.policy_class)
        super()._setup_model()

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "num_threads"]

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save as :meth:`sb3_contrib.RecurrentPPO.save`; LSTM policies are recorded as sb3-contrib's classes."""
        fast_class = self.policy_class
        if getattr(self.policy, "rnn_type", "lstm") == "lstm":
            stock = {fast: stock for stock, fast in FAST_POLICIES.items()}
            self.policy_class = stock.get(fast_class, fast_class)
        try:
            super().save(*args, **kwargs)
        finally:
            self.policy_class = fast_class
