"""torch's OpenMP idle spin: shortened while ``import sb3_speedups`` loads torch, never over the user's settings."""

import os
import subprocess
import sys

import pytest

from sb3_speedups.bench import core
from sb3_speedups.bench.worker import BenchRun
from sb3_speedups.common import openmp

# What libgomp reads as torch loads (GOMP_SPINCOUNT when ``torch`` is first imported), then the environment after.
REPORT = """
import builtins, os, sys
seen = []
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
{first}
import sb3_speedups
print(seen[0], os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


def _clean_environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in openmp.USER_VARIABLES}
    return {**env, **extra}


def _report(code: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_set_while_torch_loads_and_removed_after():
    environ: dict[str, str] = {}
    with openmp.short_spin_while_torch_loads(environ, {}) as applied:
        assert applied
        assert environ == {"GOMP_SPINCOUNT": openmp.SHORT_SPIN}
    assert environ == {}  # children inherit the user's environment


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "123"}])
def test_the_users_setting_wins(user):
    environ = dict(user)
    with openmp.short_spin_while_torch_loads(environ, {}) as applied:
        assert not applied
        assert environ == user
    assert environ == user


def test_torch_already_loaded_is_left_alone():
    environ: dict[str, str] = {}
    with openmp.short_spin_while_torch_loads(environ, {"torch": object()}) as applied:
        assert not applied
        assert environ == {}


def test_import_applies_it_in_a_fresh_process():
    assert _report(REPORT.format(first=""), _clean_environ()) == [openmp.SHORT_SPIN, "None", "None"]


def test_import_after_torch_or_with_the_users_setting_does_not():
    assert _report(REPORT.format(first="import torch"), _clean_environ()) == ["None", "None", "None"]
    passive = _clean_environ(OMP_WAIT_POLICY="PASSIVE")
    assert _report(REPORT.format(first=""), passive) == ["None", "None", "PASSIVE"]
    assert _report(REPORT.format(first=""), _clean_environ(GOMP_SPINCOUNT="50")) == ["50", "50", "None"]


@pytest.mark.parametrize(
    ("variant", "user", "expected"),
    [
        ("stock", {}, openmp.LIBGOMP_DEFAULT_SPIN),  # libgomp's default written out: the worker imports this package
        ("stock-1t", {}, openmp.LIBGOMP_DEFAULT_SPIN),
        ("ours", {}, None),  # the worker's own import sets the short spin
        ("ours@batched", {}, None),
        ("stock", {"GOMP_SPINCOUNT": "77"}, "77"),
    ],
)
def test_benchmark_runs_stock_with_libgomps_default(monkeypatch, variant, user, expected):
    for name in openmp.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 0, stdout='BENCH_RESULT {"ok": 1}\n', stderr="")

    monkeypatch.setattr(core.subprocess, "run", fake_run)
    run = BenchRun(variant=variant, algo="ppo", env_id="CartPole-v1", seed=0)
    assert core.run_subprocess(run) == {"ok": 1}
    assert seen.get("GOMP_SPINCOUNT") == expected
