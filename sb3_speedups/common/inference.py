"""Moved to :mod:`sb3_speedups.common.acting.actors`; this path stays importable for saved models, configs and user code."""

from sb3_speedups.common.acting.actors import (
    ParameterMirror,
    LeanMlp,
    box_env_actions,
    LeanActorCritic,
    policy_latents,
    lean_head,
    copy_policy,
    ModuleActorCritic,
)

__all__ = [
    "LeanActorCritic",
    "LeanMlp",
    "ModuleActorCritic",
    "ParameterMirror",
    "box_env_actions",
    "copy_policy",
    "lean_head",
    "policy_latents",
]
