"""
Copied as ``conftest.py`` next to SB3's / sb3-contrib's own tests by ``tests/compat/run.py``: before their modules
import, every stock class that we have a fast drop-in for (the registry's ``fast`` entries, and SB3's
``SubprocVecEnv``) is replaced by ours wherever the stock package exposes it. With ``SB3_SPEEDUPS_COMPAT_STOCK=1`` it
replaces nothing (the same tests against the stock classes). ``SB3_SPEEDUPS_COMPAT_SEED_OFFSET=k`` adds ``k`` to the
``seed`` every algorithm is made with (the runner's seed sweep of a learning test). Each test's outcome is written, one
JSON line each, to the file named by ``SB3_SPEEDUPS_COMPAT_OUTCOMES``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

SUBSTITUTED: list[str] = []


def _substitute(stock: type, fast: type) -> None:
    """Point every attribute of the stock package's loaded modules that names ``stock`` at ``fast``."""
    package = stock.__module__.split(".")[0]
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if value is stock:
                setattr(module, attr, fast)
                SUBSTITUTED.append(f"{name}.{attr}")


if os.environ.get("SB3_SPEEDUPS_COMPAT_STOCK") != "1":
    import sb3_contrib  # noqa: F401  (its modules loaded, so that each place that names a class is found)
    import stable_baselines3  # noqa: F401
    from stable_baselines3.common.vec_env import SubprocVecEnv

    from sb3_speedups import BatchedSubprocVecEnv
    from sb3_speedups.registry import ALGOS, import_object

    for spec in ALGOS.values():
        if spec.fast is not None:
            _substitute(import_object(spec.stock), import_object(spec.fast))
    _substitute(SubprocVecEnv, BatchedSubprocVecEnv)


SEED_OFFSET = int(os.environ.get("SB3_SPEEDUPS_COMPAT_SEED_OFFSET", "0"))
if SEED_OFFSET:
    from stable_baselines3.common.base_class import BaseAlgorithm

    _init = BaseAlgorithm.__init__

    def _init_with_offset(self: BaseAlgorithm, *args: object, **kwargs: object) -> None:
        if isinstance(kwargs.get("seed"), int):
            kwargs["seed"] = int(kwargs["seed"]) + SEED_OFFSET  # type: ignore[call-overload]
        _init(self, *args, **kwargs)  # type: ignore[arg-type]

    BaseAlgorithm.__init__ = _init_with_offset  # type: ignore[method-assign]


def pytest_report_header() -> str:
    return f"sb3_speedups substitutes {len(SUBSTITUTED)} names" if SUBSTITUTED else "sb3_speedups: stock classes"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("SB3_SPEEDUPS_COMPAT_OUTCOMES")
    if path is None or not (report.when == "call" or report.outcome != "passed"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else (str(report.longrepr) if report.skipped else "")
    with open(path, "a") as file:
        file.write(
            json.dumps({"id": report.nodeid, "when": report.when, "outcome": report.outcome, "message": message}) + "\n"
        )
