"""
Thin wrapper over ``sb3-speedups bench``:

- ``python scripts/benchmark.py --algo ppo --env CartPole-v1 ...``: ours vs stock SB3 (== ``sb3-speedups bench``);
- ``python scripts/benchmark.py vec-env --env HalfCheetah-v5 --kinds batched ...``: VecEnv throughput mode
  (== ``sb3-speedups bench-vec-env``).
"""

import sys

from sb3_speedups.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["vec-env"]:
        sys.exit(main(["bench-vec-env", *args[1:]]))
    sys.exit(main(["bench", *args]))
