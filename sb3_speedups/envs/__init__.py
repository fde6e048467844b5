"""
Environments shipped with the package, registered with gymnasium on import.

- ``<Name>NoVel-v<N>``: classic-control / Box2D envs with the velocity entries of the observation masked to zero,
  as the RL Zoo registers them (partially observable: memory helps).
- ``DelayedRecall-v0``: recall a cue shown only at the start of the episode (feed-forward policies stay at chance).
- ``InvalidActionEnvDiscrete-v0``, ``InvalidActionEnvMultiDiscrete-v0``: sb3-contrib's action-masking test envs.
- ``MaskedKnapsack-v0``: fill a knapsack item by item (action masking matters: most items become invalid).
"""

from gymnasium.envs.registration import register, registry

from sb3_speedups.envs.delayed_recall import DelayedRecallEnv
from sb3_speedups.envs.invalid_actions import INVALID_ACTION_ENVS
from sb3_speedups.envs.masked_velocity import VELOCITY_INDICES, MaskVelocityWrapper, make_masked_velocity_env

__all__ = ["VELOCITY_INDICES", "DelayedRecallEnv", "MaskVelocityWrapper", "make_masked_velocity_env", "register_envs"]


def register_envs() -> None:
    """Register the package's environments (idempotent)."""
    for base_id in VELOCITY_INDICES:
        name, _, version = base_id.rpartition("-v")
        env_id = f"{name}NoVel-v{version}"
        if env_id not in registry:
            register(
                id=env_id,
                entry_point="sb3_speedups.envs.masked_velocity:make_masked_velocity_env",
                kwargs={"base_id": base_id},
            )
    for env_id in INVALID_ACTION_ENVS:
        if env_id not in registry:
            register(
                id=env_id, entry_point="sb3_speedups.envs.invalid_actions:make_invalid_action_env", kwargs={"env_id": env_id}
            )
    if "MaskedKnapsack-v0" not in registry:
        register(id="MaskedKnapsack-v0", entry_point="sb3_speedups.envs.knapsack:MaskedKnapsackEnv")
    if "DelayedRecall-v0" not in registry:
        register(id="DelayedRecall-v0", entry_point="sb3_speedups.envs.delayed_recall:DelayedRecallEnv", max_episode_steps=64)


register_envs()
