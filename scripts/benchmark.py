"""Thin wrapper: ``python scripts/benchmark.py --algo ppo --env CartPole-v1`` == ``sb3-speedups bench ...``."""

import sys

from sb3_speedups.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
