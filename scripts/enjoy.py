"""Thin wrapper: ``python scripts/enjoy.py --algo ppo --env CartPole-v1`` == ``sb3-speedups enjoy ...``."""

import sys

from sb3_speedups.cli import main

if __name__ == "__main__":
    sys.exit(main(["enjoy", *sys.argv[1:]]))
