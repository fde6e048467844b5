"""
``make compat``: SB3's and sb3-contrib's own test suites with every fast class of ours substituted.

Downloads the sdists of the installed ``stable-baselines3`` and ``sb3-contrib`` (both ship ``tests/``), copies their
tests and pytest configuration to a temporary folder (so that the installed packages are the ones imported), adds
``conftest_fast.py`` as their ``conftest.py`` and runs them. Tests that fail are run again against the stock classes:
one that fails for both is listed with stock's reason and not counted against us. A test that fails for ours alone is
run again with :data:`SWEEP_SEEDS` other seeds, ours and stock: a test of one seed's learning luck (stock fails on
some seeds too) counts against us only when ours succeeds clearly less often than stock (see :func:`clearly_fewer`).
Exit status 0 when nothing fails for ours alone.

    python -m tests.compat.run [--suite sb3|contrib] [-k EXPR] [--keep DIR] [pytest args...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE.parents[1] / ".compat-cache"  # downloaded sdists, kept between runs (git-ignored)
SUITES = {"sb3": "stable-baselines3", "contrib": "sb3-contrib"}
CONFIG_FILES = ("pyproject.toml", "setup.cfg")
# Seeds of the sweep (offsets 1..SWEEP_SEEDS added to the test's own seed), each a fresh pytest run for ours and stock.
SWEEP_SEEDS = 10
# One-sided z for "clearly fewer successes" (~0.5% when ours and stock succeed equally often).
SWEEP_Z = 2.58


@dataclass
class Outcome:
    """One test's result: its pytest outcome and, for a failure, the first line of the error."""

    outcome: str
    message: str


def sdist(dist: str) -> Path:
    """:return: the sdist of the installed version of ``dist``, downloaded into the cache once"""
    wanted = f"{dist.replace('-', '_')}-{version(dist)}.tar.gz"
    path = CACHE / wanted
    if not path.exists():
        CACHE.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(CACHE)]
        subprocess.run([*cmd, f"{dist}=={version(dist)}"], check=True)
        if not path.exists():
            raise FileNotFoundError(f"pip did not leave {wanted} in {CACHE}")
    return path


def unpack_tests(tarball: Path, dest: Path) -> Path:
    """:return: a folder holding the sdist's ``tests/`` and its pytest configuration, outside the package's source"""
    with tarfile.open(tarball) as tar:
        root = tar.getnames()[0].split("/")[0]
        keep = [
            m
            for m in tar.getmembers()
            if m.name.startswith(f"{root}/tests/") or m.name in {f"{root}/{c}" for c in CONFIG_FILES}
        ]
        tar.extractall(dest, members=keep, filter="data")
    folder = dest / root
    shutil.copy(HERE / "conftest_fast.py", folder / "conftest.py")
    return folder


def run_pytest(folder: Path, args: list[str], stock: bool, seed_offset: int = 0) -> dict[str, Outcome]:
    """
    :param seed_offset: added to every algorithm's ``seed``
    :return: each test's outcome, run in ``folder`` with our classes substituted (or the stock ones)
    """
    outcomes_file = folder / ("outcomes-stock.jsonl" if stock else "outcomes.jsonl")
    outcomes_file.unlink(missing_ok=True)
    env = {
        **os.environ,
        "SB3_SPEEDUPS_COMPAT_OUTCOMES": str(outcomes_file),
        "SB3_SPEEDUPS_COMPAT_STOCK": "1" if stock else "0",
        "SB3_SPEEDUPS_COMPAT_SEED_OFFSET": str(seed_offset),
    }
    cmd = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-o", "timeout=600", *args]
    subprocess.run(cmd, cwd=folder, env=env, check=False)
    outcomes: dict[str, Outcome] = {}
    if outcomes_file.exists():
        for line in outcomes_file.read_text().splitlines():
            row = json.loads(line)
            if row["id"] not in outcomes or outcomes[row["id"]].outcome == "passed":  # a teardown error counts
                outcomes[row["id"]] = Outcome(row["outcome"], row["message"].splitlines()[0] if row["message"] else "")
    return outcomes


def clearly_fewer(ours: int, stock: int, n: int) -> bool:
    """
    :return: whether ``ours`` successes out of ``n`` are fewer than ``stock``'s by more than chance allows: the
        difference against ``SWEEP_Z`` standard deviations of the difference of two binomials of the pooled rate
    """
    pooled = (ours + stock) / (2 * n)
    return stock - ours > SWEEP_Z * math.sqrt(2 * n * pooled * (1 - pooled))


def seed_sweep(folder: Path, test: str) -> tuple[int, int]:
    """:return: how often ``test`` passes for ours and for stock over the sweep's seeds"""
    passes = [0, 0]
    for offset in range(1, SWEEP_SEEDS + 1):
        for side, stock in enumerate((False, True)):
            outcome = run_pytest(folder, ["--tb=no", test], stock=stock, seed_offset=offset).get(test)
            passes[side] += outcome is not None and outcome.outcome == "passed"
    return passes[0], passes[1]


def report(name: str, ours: dict[str, Outcome], stock: dict[str, Outcome]) -> list[str]:
    """Prints the suite's figures and the failures; :return: the tests that fail for ours only"""
    count = {kind: sum(o.outcome == kind for o in ours.values()) for kind in ("passed", "failed", "skipped")}
    failed = sorted(test for test, o in ours.items() if o.outcome == "failed")
    both = [test for test in failed if stock.get(test, Outcome("missing", "")).outcome == "failed"]
    ours_only = [test for test in failed if test not in both]
    print(f"\n== {name} with our classes: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
    if both:
        print(f"-- failing for stock too ({len(both)}), not counted:")
        for test in both:
            print(f"   {test}: {stock[test].message}")
    if ours_only:
        print(f"-- failing for ours only ({len(ours_only)}):")
        for test in ours_only:
            print(f"   {test}: {ours[test].message}")
    return ours_only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), action="append", help="one suite (default: both)")
    parser.add_argument("--keep", type=Path, help="unpack into this folder and keep it (default: a temporary one)")
    args, pytest_args = parser.parse_known_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="sb3-speedups-compat-"))
    ours_only: list[str] = []
    try:
        for suite in args.suite or list(SUITES):
            folder = unpack_tests(sdist(SUITES[suite]), work)
            ours = run_pytest(folder, pytest_args, stock=False)
            failed = [test for test, o in ours.items() if o.outcome == "failed"]
            stock = run_pytest(folder, [*failed], stock=True) if failed else {}
            for test in report(f"{SUITES[suite]} {version(SUITES[suite])}", ours, stock):
                ours_passes, stock_passes = seed_sweep(folder, test)
                luck = stock_passes < SWEEP_SEEDS and not clearly_fewer(ours_passes, stock_passes, SWEEP_SEEDS)
                verdict = "one seed's luck, not counted" if luck else "counted against us"
                print(f"   {test} over {SWEEP_SEEDS} more seeds: ours passes {ours_passes}, stock {stock_passes}: {verdict}")
                if not luck:
                    ours_only.append(test)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{len(ours_only)} failed for ours only" if ours_only else "\nno test fails for ours only")
    return 1 if ours_only else 0


if __name__ == "__main__":
    sys.exit(main())
