"""Every ```python block of README.md runs as a fresh script, with a small training budget, without any warning."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
# The README shows real budgets (`.learn(100_000)`); the test only needs a rollout or two of each.
LEARN_BUDGET = re.compile(r"\.learn\((?:total_timesteps=)?[\d_]+")
SMALL_BUDGET = 512


def readme_python_blocks() -> list[str]:
    """:return: the code of every ```python block of README.md, in order"""
    return PYTHON_BLOCK.findall((ROOT / "README.md").read_text())


def with_small_budget(code: str) -> str:
    """
    :param code: a README block
    :return: the block with every ``.learn(<number>)`` budget replaced by ``SMALL_BUDGET``
    """
    return LEARN_BUDGET.sub(f".learn({SMALL_BUDGET}", code)


def test_readme_has_python_blocks_with_budgets_the_test_can_cut():
    blocks = readme_python_blocks()
    assert blocks
    for code in blocks:
        if ".learn(" in code:
            assert LEARN_BUDGET.search(code), f"a .learn() budget the test cannot cut:\n{code}"


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block_runs_without_warnings(index: int, tmp_path: Path):
    code = with_small_budget(readme_python_blocks()[index])
    # A fresh interpreter, so that warnings already shown by other tests (once per place) are raised again here;
    # the checkout's package first on the path, as in a clone installed with `pip install -e .`.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr:\n{result.stderr}"
    assert result.stderr == "", f"README block {index} wrote to stderr:\n{result.stderr}"


def test_readme_is_a_users_page_of_at_most_300_lines():
    """The README stays a user's page: dated measurements and details live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
