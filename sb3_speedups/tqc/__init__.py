"""Fast drop-in TQC (sb3-contrib's Truncated Quantile Critics)."""

from sb3_speedups.tqc.tqc import TQC

__all__ = ["TQC"]
