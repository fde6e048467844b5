"""Moved to :mod:`sb3_speedups.common.replay.sampling`; this path stays importable for saved models, configs and user code."""

from sb3_speedups.common.replay.sampling import (
    IndexDraw,
    batched_sampling_supported,
    draw_indices,
    newest_indices,
    gather,
    sample_minibatches,
    batchable,
    chunk_sizes,
)

__all__ = [
    "IndexDraw",
    "batchable",
    "batched_sampling_supported",
    "chunk_sizes",
    "draw_indices",
    "gather",
    "newest_indices",
    "sample_minibatches",
]
