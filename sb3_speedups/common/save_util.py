"""Atomic saves: write to a temporary file in the same folder, then rename over the target."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.vec_env import VecNormalize


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """
    Yield a temporary path next to ``path``; on success it replaces ``path`` in one rename, on error it is removed,
    so readers never see a half-written file. The file gets the mode an ordinary write would (``0o666`` less the
    umask), as SB3's own ``save`` does; ``tempfile.mkstemp`` would leave it private (``0o600``).

    :param path: the final file path (with its suffix)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_temp_file(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _create_temp_file(path: Path) -> Path:
    """:return: a new empty file next to ``path``, created with mode ``0o666`` so that the umask applies"""
    while True:
        tmp = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """
    :param path: final path
    :param write: writes the content to the path it is given
    :return: ``path``
    """
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def save_model(model: BaseAlgorithm, path: str | Path) -> Path:
    """
    ``model.save`` done atomically.

    :param model: the algorithm
    :param path: destination; ``.zip`` is appended when it has no suffix, as SB3 does
    :return: the final path
    """
    path = Path(path)
    if path.suffix == "":
        path = path.with_suffix(".zip")
    return atomic_write(path, model.save)


def save_vecnormalize(env: VecNormalize, path: str | Path) -> Path:
    """
    ``VecNormalize.save`` done atomically.

    :param env: the normalisation wrapper
    :param path: destination (``vecnormalize.pkl``)
    :return: the final path
    """
    return atomic_write(path, lambda tmp: env.save(str(tmp)))
