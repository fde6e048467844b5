"""Moved to :mod:`sb3_speedups.dqn.update`; this path stays importable for saved models, configs and user code."""

from sb3_speedups.dqn.update import q_mlp_unsupported_reason, huber_, ManualQUpdate, AutogradQUpdate

__all__ = ["AutogradQUpdate", "ManualQUpdate", "huber_", "q_mlp_unsupported_reason"]
