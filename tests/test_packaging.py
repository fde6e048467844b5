"""The hyperparameter files ship inside the wheel and are found from an installed (non-editable) package."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT


def test_wheel_ships_hyperparams_and_finds_them_installed(tmp_path: Path):
    wheel_builder = pytest.importorskip("hatchling.builders.wheel")
    wheel = Path(next(iter(wheel_builder.WheelBuilder(str(REPO_ROOT)).build(directory=str(tmp_path), versions=["standard"]))))
    names = zipfile.ZipFile(wheel).namelist()
    for algo in ("ppo", "dqn", "ppo_lstm"):
        assert f"sb3_speedups/hyperparams/{algo}.yml" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "from sb3_speedups.zoo.hyperparams import bundled_hyperparams_dir, read_hyperparams;"
        "print(bundled_hyperparams_dir()); print(read_hyperparams('ppo', 'CartPole-v1')['n_envs'])"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    ).stdout.split()
    assert out == [str(site / "sb3_speedups" / "hyperparams"), "8"]
