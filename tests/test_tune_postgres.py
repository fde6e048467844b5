"""
A distributed study: two ``tune`` processes share one study on a real PostgreSQL server (as on two machines).
``.ci/postgres.sh`` starts a local server and exports ``SB3_SPEEDUPS_TEST_POSTGRES_URL``; without it the test is
skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import optuna
import pytest
import yaml

from sb3_speedups.errors import UserError
from sb3_speedups.tune.storage import open_storage

ROOT = Path(__file__).resolve().parents[1]
URL_VARIABLE = "SB3_SPEEDUPS_TEST_POSTGRES_URL"

pytestmark = pytest.mark.postgres


@pytest.fixture
def postgres_url() -> str:
    url = os.environ.get(URL_VARIABLE)
    if not url:
        pytest.skip(f"{URL_VARIABLE} is not set: no PostgreSQL server (.ci/postgres.sh starts one in CI)")
    try:
        import psycopg2  # noqa: F401
    except ModuleNotFoundError:
        pytest.skip("psycopg2 is not installed (pip install 'sb3-speedups[postgres]')")
    try:
        open_storage(url)
    except UserError as exc:
        pytest.skip(f"PostgreSQL server at {URL_VARIABLE} is not usable: {exc}")
    return url


@pytest.mark.slow
def test_two_processes_share_one_study(tmp_path: Path, postgres_url: str) -> None:
    name = f"test-{uuid.uuid4().hex[:12]}"
    space = tmp_path / "space.yml"
    space.write_text(yaml.safe_dump({"replace": True, "params": {"n_steps": [32], "batch_size": [128], "n_epochs": [2, 4]}}))
    args = ["--algo", "ppo", "--env", "CartPole-v1", "-n", "4096", "--n-eval-episodes", "2", "--n-evaluations", "2"]
    args += ["--n-trials", "4", "--storage", postgres_url, "--study-name", name, "--search-space", str(space), "--no-plots"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "sb3_speedups", "tune", *args, "--seed", str(seed), "-f", str(tmp_path / f"w{seed}")],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for seed in (1, 2)  # each process its own sampler seed, as the README says
    ]
    outputs = [proc.communicate(timeout=300)[0].decode() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(postgres_url))
        finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
        # one study reached the shared target (a start-up race may add one trial per extra process)
        assert 4 <= len(finished) <= 5 and len(study.trials) == len(finished)
        workers = {t.user_attrs["worker"].rsplit(":", 1)[0] for t in study.trials}
        assert len(workers) == 2  # both processes ran trials of it
        for output in outputs:
            assert f"Study {name}:" in output  # each printed the summary of the whole study
    finally:
        optuna.delete_study(study_name=name, storage=open_storage(postgres_url))
