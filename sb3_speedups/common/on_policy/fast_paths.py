"""What PPO and A2C share to take their fast paths: when a hand-derived update and the frozen actor can run a model."""

from __future__ import annotations

from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm

from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.common.nn.actor_critic import mlp_unsupported_reason
from sb3_speedups.common.nn.inputs import flat_input_unsupported_reason


def mlp_model_unsupported_reason(model: OnPolicyAlgorithm) -> str | None:
    """
    :param model: the model
    :return: why its policy is not a plain MLP actor-critic on observations the MLP executors take (flat ``Box``,
        ``Discrete``, ``MultiDiscrete``, ``MultiBinary``) with a hand-derived action head and no gSDE (what the
        hand-derived updates and the frozen actor need), or ``None``
    """
    if model.use_sde:
        return "gSDE"
    reason = flat_input_unsupported_reason(model.observation_space) or mlp_unsupported_reason(model.policy)
    if reason is None and make_head(model.policy.action_dist, model.action_space) is None:
        reason = f"action distribution {type(model.policy.action_dist).__name__} has no hand-derived gradient"
    return reason
