"""Moved to :mod:`sb3_speedups.dqn.replay.buffers`; this path stays importable for saved models, configs and user code."""

from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBufferSamples, PrioritizedReplayBuffer

__all__ = ["PrioritizedReplayBuffer", "PrioritizedReplayBufferSamples"]
