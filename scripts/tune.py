"""Thin wrapper: ``python scripts/tune.py --algo ppo --env CartPole-v1`` == ``sb3-speedups tune ...``."""

import sys

from sb3_speedups.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
