"""The pieces of ``make compat`` (``tests/compat/``): unpacking an sdist's tests, the seed offset and the sweep's rule."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from tests.compat.run import SWEEP_SEEDS, clearly_fewer, run_pytest, unpack_tests


def _sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"pkg-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_only_the_tests_and_their_config_are_unpacked_beside_our_conftest(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "tests/test_a.py": "def test_a(): pass\n", "pyproject.toml": "", "setup.py": ""}
    folder = unpack_tests(_sdist(tmp_path / "pkg-1.0.tar.gz", files), tmp_path / "out")
    found = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert found == ["conftest.py", "pyproject.toml", "tests/test_a.py"]  # not the package: the installed one is tested


def test_the_seed_offset_reaches_every_algorithm_and_outcomes_are_read(tmp_path: Path) -> None:
    files = {
        "tests/test_seed.py": (
            "from stable_baselines3 import PPO\n"
            "def test_seed():\n"
            "    assert PPO('MlpPolicy', 'CartPole-v1', seed=1, n_steps=64).seed == 4\n"
        ),
        "pyproject.toml": "",
    }
    folder = unpack_tests(_sdist(tmp_path / "pkg-1.0.tar.gz", files), tmp_path / "out")
    assert run_pytest(folder, [], stock=True, seed_offset=3)["tests/test_seed.py::test_seed"].outcome == "passed"
    failed = run_pytest(folder, [], stock=False, seed_offset=0)["tests/test_seed.py::test_seed"]
    assert failed.outcome == "failed" and "assert 1 == 4" in failed.message


def test_the_sweep_counts_only_clearly_fewer_successes_against_us() -> None:
    n = SWEEP_SEEDS
    assert not clearly_fewer(n // 2, n // 2, n)
    assert not clearly_fewer(n // 2 - 2, n // 2 + 2, n)  # a difference chance gives often
    assert clearly_fewer(0, n // 2, n)  # ours never learns what stock learns on half the seeds
    assert clearly_fewer(n // 4, n - 1, n)
    assert not clearly_fewer(n, 0, n)
