"""Moved to :mod:`sb3_speedups.dqn.update`; this path stays importable for saved models, configs and user code."""

from sb3_speedups.dqn.update import q_mlp_unsupported_reason, huber_, HandDerivedQUpdate, AutogradQUpdate

__all__ = ["AutogradQUpdate", "HandDerivedQUpdate", "huber_", "q_mlp_unsupported_reason"]
