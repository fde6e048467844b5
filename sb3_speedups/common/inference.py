"""Moved to :mod:`sb3_speedups.common.acting.actors`; this path stays importable for saved models, configs and user code."""

from sb3_speedups.common.acting.actors import (
    ParameterMirror,
    TorchMlp,
    box_env_actions,
    FrozenActorCritic,
    policy_latents,
    standard_head,
    copy_policy,
    ModuleActorCritic,
)

__all__ = [
    "FrozenActorCritic",
    "ModuleActorCritic",
    "ParameterMirror",
    "TorchMlp",
    "box_env_actions",
    "copy_policy",
    "policy_latents",
    "standard_head",
]
