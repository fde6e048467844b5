"""
RayVecEnv: argument checks and the missing-extra message here; everything else on a real two-node Ray cluster
(``tests/ray_cluster_checks.py``, run once inside ``scripts/ray_local_cluster.sh`` so that Ray sees loopback only),
reported here check by check.
"""

from __future__ import annotations

import ast
import os
import secrets
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sb3_speedups.cli import main
from sb3_speedups.errors import UserValueError
from tests.helpers import REPO_ROOT, subprocess_env

CHECKS = Path(__file__).with_name("ray_cluster_checks.py")
CLUSTER_SCRIPT = REPO_ROOT / "scripts" / "ray_local_cluster.sh"
NO_RAY = "import sys; sys.modules['ray'] = None; "
# The whole cluster run (start-up, every check, shutdown): generous, as a busy 2-core machine can be ten times slower.
CLUSTER_TIMEOUT_S = 840


def check_names() -> list[str]:
    """The checks of ``ray_cluster_checks.py`` (parametrised ones once: their cases are reported together)."""
    tree = ast.parse(CHECKS.read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def namespace_problem() -> str | None:
    """:return: why the loopback-only cluster cannot run here, or ``None``"""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return "cannot make a network namespace here (unshare needs root): Ray must not use any address but loopback"
    return None


@pytest.fixture(scope="module")
def cluster_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[str]], str]:
    pytest.importorskip("ray")
    problem = namespace_problem()
    if problem is not None:
        pytest.skip(problem)
    report = tmp_path_factory.mktemp("ray") / "report.xml"
    env = {**subprocess_env(), "PYTHON": sys.executable}
    env.pop("RAY_ADDRESS", None)
    cmd = [str(CLUSTER_SCRIPT), sys.executable, "-m", "pytest", str(CHECKS), "-p", "no:randomly", "-p", "no:cacheprovider",
           "-q", "-o", "timeout=240", f"--junitxml={report}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=CLUSTER_TIMEOUT_S, check=False)
    output = (proc.stdout + proc.stderr)[-20000:]  # the inner pytest's failures, with their captured output
    if not report.exists():
        pytest.fail(f"the checks did not run (exit {proc.returncode}):\n{output}")
    outcomes: dict[str, list[str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes.setdefault(name, []).append(outcome)
    return outcomes, output


@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TIMEOUT_S + 60)  # the first of these runs the cluster in its set-up
@pytest.mark.parametrize("name", check_names())
def test_on_a_two_node_cluster(name: str, cluster_results: tuple[dict[str, list[str]], str]) -> None:
    outcomes, output = cluster_results
    assert name in outcomes, f"{name} did not run:\n{output}"
    assert set(outcomes[name]) == {"passed"}, f"{name}: {outcomes[name]}\n{output}"


# One task pinned to each alive node; prints the node count and whether every node ran its task.
ONE_TASK_PER_NODE = """
import os, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
where = ray.remote(lambda: ray.get_runtime_context().get_node_id())
ran_on = ray.get([where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes])
print(len(nodes), sorted(ran_on) == nodes)
"""


@pytest.mark.slow
def test_cluster_ignores_the_token_in_the_users_home(tmp_path: Path) -> None:
    """A local ``ray.init()`` (Ray >= 2.59) leaves ``~/.ray/auth_token``, which made the head turn token auth on and
    the second node fail to join. Ray's own format: 64 hex digits, no newline."""
    pytest.importorskip("ray")
    problem = namespace_problem()
    if problem is not None:
        pytest.skip(problem)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {**subprocess_env(), "PYTHON": sys.executable, "HOME": str(tmp_path)}
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    cmd = [str(CLUSTER_SCRIPT), sys.executable, "-c", ONE_TASK_PER_NODE]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=240, check=False)
    assert proc.stdout.split() == ["2", "True"], f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-5000:]}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_workers": 2, "envs_per_worker": 2}, "not both"),
        ({"n_workers": 0}, "n_workers must be a positive integer"),
        ({"envs_per_worker": 1.5}, "envs_per_worker must be a positive integer"),
        ({"num_cpus": -1}, "num_cpus must be >= 0"),
    ],
)
def test_bad_arguments_fail_before_ray_starts(kwargs: dict, message: str) -> None:
    ray_vec_env = pytest.importorskip("sb3_speedups.common.vec_env.ray_vec_env")
    with pytest.raises(UserValueError, match=message):
        ray_vec_env.RayVecEnv([lambda: None] * 2, **kwargs)
    with pytest.raises(UserValueError, match="at least one env"):
        ray_vec_env.RayVecEnv([])


def test_without_ray_the_package_works_and_ray_vec_env_names_the_extra(tmp_path: Path) -> None:
    code = NO_RAY + (
        "import sb3_speedups\n"
        "from sb3_speedups import *\n"
        "try:\n"
        "    sb3_speedups.RayVecEnv\n"
        "except ImportError as exc:\n"
        "    print('ERROR', exc)\n"
        "from sb3_speedups.cli import main\n"
        f"sys.exit(main(['train', '--algo', 'ppo', '--env', 'CartPole-v1', '--vec-env', 'ray', '-f', {str(tmp_path)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert "ERROR RayVecEnv needs Ray, which is not installed: pip install 'sb3-speedups[ray]'" in proc.stdout
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sb3-speedups train: error: RayVecEnv needs Ray, which is not installed: pip install 'sb3-speedups[ray]'"
    ]
    assert not os.listdir(tmp_path), "no run folder before the error"


def test_ray_address_needs_the_ray_vec_env(capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--algo", "ppo", "--env", "CartPole-v1", "--ray-address", "auto"]) == 2
    assert "--ray-address is an option of --vec-env ray" in capsys.readouterr().err
