"""Helpers for tests that run the real CLI in a subprocess importing this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: this checkout first on the import path."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "NO_COLOR": "1"}


def cli_command(*args: str) -> list[str]:
    """:return: the argv of ``python -m sb3_speedups ARGS``"""
    return [sys.executable, "-m", "sb3_speedups", *args]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m sb3_speedups ARGS`` to completion."""
    return subprocess.run(cli_command(*args), capture_output=True, text=True, cwd=cwd, env=subprocess_env(), timeout=timeout)
