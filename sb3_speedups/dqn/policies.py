"""
Dueling Q-networks (Wang et al. 2016): ``Q(s, a) = V(s) + A(s, a) - mean_a A(s, a)``.

The layers of ``net_arch`` but the last are shared; the value and the advantage stream each have one hidden layer
of ``net_arch[-1]`` units and a linear output (with an empty ``net_arch``, both streams are linear on the features).
Only ``policy_kwargs=dict(dueling=True)`` selects these classes, so models without dueling heads keep stock SB3's
policy classes (and load without this package).
"""

from __future__ import annotations

from typing import Any

import torch as th
from stable_baselines3.common.torch_layers import create_mlp
from stable_baselines3.common.type_aliases import PyTorchObs
from stable_baselines3.dqn.policies import CnnPolicy, DQNPolicy, MultiInputPolicy, QNetwork
from torch import nn


class DuelingQNetwork(QNetwork):
    """
    A ``QNetwork`` with a value and an advantage stream; same constructor as :class:`stable_baselines3.dqn.policies.QNetwork`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        n_actions = int(self.action_space.n)  # type: ignore[attr-defined]
        shared = self.net_arch[:-1]
        stream = self.net_arch[-1:]
        trunk_dim = shared[-1] if shared else self.features_dim
        # Replaces the stock single stream built by QNetwork.__init__.
        self.q_net = nn.Sequential(*create_mlp(self.features_dim, -1, shared, self.activation_fn)) if shared else nn.Identity()  # type: ignore[assignment]
        self.value_stream = nn.Sequential(*create_mlp(trunk_dim, 1, stream, self.activation_fn))
        self.advantage_stream = nn.Sequential(*create_mlp(trunk_dim, n_actions, stream, self.activation_fn))

    def forward(self, obs: PyTorchObs) -> th.Tensor:
        """:return: the Q-values ``[n, n_actions]``"""
        trunk = self.q_net(self.extract_features(obs, self.features_extractor))
        advantages = self.advantage_stream(trunk)
        return self.value_stream(trunk) + advantages - advantages.mean(dim=1, keepdim=True)


class _Dueling:
    """Builds :class:`DuelingQNetwork` instead of ``QNetwork``; the ``dueling`` argument is kept for saving."""

    def __init__(self, *args: Any, dueling: bool = True, **kwargs: Any) -> None:
        if not dueling:
            raise ValueError("dueling policies need dueling=True; use the stock policy class otherwise")
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def make_q_net(self) -> QNetwork:
        net_args = self._update_features_extractor(self.net_args, features_extractor=None)  # type: ignore[attr-defined]
        return DuelingQNetwork(**net_args).to(self.device)  # type: ignore[attr-defined]

    def _get_constructor_parameters(self) -> dict[str, Any]:
        return {**super()._get_constructor_parameters(), "dueling": True}  # type: ignore[misc]


class DuelingMlpPolicy(_Dueling, DQNPolicy):
    """``MlpPolicy`` with dueling heads."""


class DuelingCnnPolicy(_Dueling, CnnPolicy):
    """``CnnPolicy`` with dueling heads."""


class DuelingMultiInputPolicy(_Dueling, MultiInputPolicy):
    """``MultiInputPolicy`` with dueling heads."""


#: stock alias -> dueling class
DUELING_POLICIES: dict[str, type[DQNPolicy]] = {
    "MlpPolicy": DuelingMlpPolicy,
    "CnnPolicy": DuelingCnnPolicy,
    "MultiInputPolicy": DuelingMultiInputPolicy,
}
