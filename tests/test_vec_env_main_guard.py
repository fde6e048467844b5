"""A script without a main guard: spawn and forkserver workers run it again; the error says so, and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

SCRIPT = """
from sb3_speedups import BatchedSubprocVecEnv, make_vec_env

{guard}env = make_vec_env("CartPole-v1", n_envs=2, vec_env_cls=BatchedSubprocVecEnv,
{indent}                   vec_env_kwargs=dict(n_workers=1, n_local=0{start_method}))
{indent}env.reset()
{indent}env.close()
{indent}print("done")
"""


def _run(tmp_path: Path, guard: bool, start_method: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / f"script_{guard}_{start_method or 'default'}.py"
    indent = "    " if guard else ""
    script.write_text(SCRIPT.format(
        guard='if __name__ == "__main__":\n    ' if guard else "", indent=indent,
        start_method=f", start_method={start_method!r}" if start_method else "",
    ))  # fmt: skip
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(), timeout=120
    )


@pytest.mark.skipif(sys.platform == "win32", reason="forkserver")
def test_a_script_without_main_guard_gets_the_cause_and_the_fix_in_one_line(tmp_path: Path) -> None:
    failed = _run(tmp_path, guard=False)
    assert failed.returncode == 1 and "done" not in failed.stdout
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("sb3_speedups.common.vec_env.pool.WorkerDiedError: BatchedSubprocVecEnv worker 0 exited")
    assert "forkserver start method re-imports the main script" in last and "script_False_default.py" in last
    assert """has no 'if __name__ == "__main__":' guard""" in last
    assert 'start_method="fork"' in last
    # both fixes work
    assert _run(tmp_path, guard=True).stdout.strip() == "done"
    assert _run(tmp_path, guard=False, start_method="fork").stdout.strip() == "done"
