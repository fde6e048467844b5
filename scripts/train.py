"""Thin wrapper: ``python scripts/train.py --algo ppo --env CartPole-v1`` == ``sb3-speedups train ...``."""

import sys

from sb3_speedups.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
