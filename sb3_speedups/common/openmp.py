"""
How long torch's OpenMP threads spin after a parallel region (libgomp, the OpenMP of torch's Linux wheels).

By default libgomp's idle threads poll for ~300,000 rounds (milliseconds) before they sleep. After a convolutional
policy acts for one vectorised step, the second core's torch thread keeps polling through the envs' step, and envs
that step in other processes or threads (``BatchedSubprocVecEnv``'s worker, ALE's vector env) lose that core: measured
in docs/benchmarks.md ("torch's OpenMP threads spin through the envs' steps"). A short spin still covers the
microseconds between one product's parallel regions. It changes no number, only when a waiting thread sleeps.

libgomp reads its settings once, when torch loads, so :func:`short_spin_while_torch_loads` must run before the
first ``import torch``: ``import sb3_speedups`` does it first. Nothing is changed where torch is already loaded, or
where the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (their choice wins). This module imports no torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

#: the user's own settings of libgomp's wait, which are never overridden
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: polls before an idle thread sleeps: ~20 us at libgomp's own estimate of 100,000 polls a millisecond
SHORT_SPIN = "2000"
#: libgomp's default without ``OMP_WAIT_POLICY`` (what stock SB3 runs with), written out for stock's benchmark runs
LIBGOMP_DEFAULT_SPIN = "300000"


def _user_set(environ: Mapping[str, str]) -> bool:
    """:return: whether ``environ`` holds the user's own setting of libgomp's wait"""
    return any(name in environ for name in USER_VARIABLES)


@contextmanager
def short_spin_while_torch_loads(
    environ: MutableMapping[str, str] = os.environ, modules: Mapping[str, object] = sys.modules
) -> Iterator[bool]:
    """
    Set ``GOMP_SPINCOUNT`` to :data:`SHORT_SPIN` for the ``import torch`` inside the block, then remove it again, so
    that the processes this one starts inherit the user's environment unchanged.

    :param environ: the process environment
    :param modules: the loaded modules
    :return: (as the block's target) whether the short spin is set for the block
    """
    if "torch" in modules or _user_set(environ):
        yield False
        return
    environ["GOMP_SPINCOUNT"] = SHORT_SPIN
    try:
        yield True
    finally:
        environ.pop("GOMP_SPINCOUNT", None)


def stock_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """
    :param environ: an environment for a process that imports this package and then runs stock SB3
    :return: that environment with libgomp's default spin written out (unless the user set their own), so that the
        package's import leaves stock's threads as stock runs them
    """
    env = dict(environ)
    if not _user_set(env):
        env["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT_SPIN
    return env
