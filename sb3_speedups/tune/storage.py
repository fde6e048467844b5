"""Where a study lives (SQLite file, journal file, database server) and the Optuna sampler and pruner of a run."""

from __future__ import annotations

import importlib.util
import re
import time
import warnings
from pathlib import Path

import optuna
from optuna.pruners import BasePruner, MedianPruner, NopPruner, SuccessiveHalvingPruner
from optuna.samplers import BaseSampler, CmaEsSampler, RandomSampler, TPESampler
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import ArgumentError

from sb3_speedups.errors import UserError
from sb3_speedups.tune import PRUNERS, SAMPLERS

DEFAULT_STORAGE_FILE = "study.db"
# A trial whose process died without a word (kill -9, power loss) is failed after this long without a heartbeat.
HEARTBEAT_INTERVAL_S = 30
GRACE_PERIOD_S = 120
STORAGE_ATTEMPTS = 3
_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def study_folder(log_folder: str | Path, study_name: str) -> Path:
    """:return: the folder of a study's outputs (and of its default SQLite file): ``<log_folder>/tune/<study_name>``"""
    return Path(log_folder) / "tune" / re.sub(r"[^\w.-]", "_", study_name)


def storage_url(storage: str | None, folder: Path) -> str:
    """
    :param storage: ``--storage``: ``None`` (SQLite file in ``folder``), a ``*.log`` journal file, a SQLite file
        (``*.db``) or a database URL (``postgresql://user@host/db``, ``sqlite:///path``)
    :param folder: the study folder
    :return: the canonical form: a URL, or the journal file path
    """
    if storage is None:
        return f"sqlite:///{(folder / DEFAULT_STORAGE_FILE).resolve()}"
    if storage.endswith(".log") and "://" not in storage:
        return str(Path(storage).resolve())
    if storage.endswith(_SQLITE_SUFFIXES) and "://" not in storage:
        return f"sqlite:///{Path(storage).resolve()}"
    if re.match(r"^[a-z][a-z0-9+]*://", storage):
        return storage
    raise UserError(
        f"cannot use --storage {storage!r}: give a file ending in .log (journal) or .db (SQLite), "
        "or a database URL such as postgresql://user:password@host/database"
    )


def open_storage(url: str) -> BaseStorage:
    """
    :param url: from :func:`storage_url`
    :return: the Optuna storage (RDB storages with heartbeats, so that trials of dead processes get failed)
    """
    if "://" not in url:
        Path(url).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(url))
    url = _with_postgres_driver(url)
    engine_kwargs: dict = {}
    if url.startswith("sqlite:"):
        Path(url.partition(":///")[2]).parent.mkdir(parents=True, exist_ok=True)
        # several worker processes share the file: wait for the lock instead of failing; no implicit transactions
        # from the driver (see _serialize_sqlite_transactions)
        engine_kwargs["connect_args"] = {"timeout": 60, "isolation_level": None}
    else:
        engine_kwargs["pool_pre_ping"] = True
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats are stable in practice
                storage = RDBStorage(
                    url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_INTERVAL_S, grace_period=GRACE_PERIOD_S
                )
            if url.startswith("sqlite:"):
                _serialize_sqlite_transactions(storage.engine)
            return storage
        except ImportError as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
            extra = " (pip install 'sb3-speedups[postgres]')" if url.startswith("postgresql") else ""
            raise UserError(f"cannot open storage {_redact(url)}: missing database driver {cause.name}{extra}") from None
        except Exception as exc:  # sqlalchemy's errors: bad URL, server down, authentication, a concurrent set-up
            if attempt + 1 < STORAGE_ATTEMPTS and not isinstance(exc, (ValueError, ImportError, ArgumentError)):
                # processes starting together on a new database race to create its tables: the loser retries
                time.sleep(1.0 + attempt)
                continue
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"cannot open storage {_redact(url)}: {first_line}; check the URL and that the server runs"
            ) from None
    raise AssertionError("unreachable")


def _serialize_sqlite_transactions(engine: Engine) -> None:
    """
    Make every transaction on a SQLite file take the write lock when it begins (``BEGIN IMMEDIATE``).

    Python's sqlite3 driver starts a transaction only at the first write, so a read-check-write such as Optuna
    claiming a queued (WAITING) trial is not atomic: two worker processes both read WAITING and both set RUNNING,
    run the same trial, and the second one fails when it reports. PostgreSQL's ``SELECT ... FOR UPDATE``, which
    Optuna uses, has no such gap.
    """

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections made before the listener start their transactions from now on too


def _with_postgres_driver(url: str) -> str:
    """A bare ``postgresql://`` means SQLAlchemy's default driver, which depends on its version: name one that is here."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres"):
        return url
    for module, driver in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{driver}{sep}{rest}"
    return url


def _redact(url: str) -> str:
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def describe_storage(url: str) -> str:
    """:return: the storage for printing, without its password"""
    return _redact(url) if "://" in url else f"journal file {url}"


def make_sampler(name: str, n_startup_trials: int, seed: int | None) -> BaseSampler:
    """
    :param name: ``tpe``, ``random`` or ``cmaes``
    :param n_startup_trials: random trials before the model-based sampler takes over
    :param seed: sampler seed
    :return: the sampler
    """
    if name == "tpe":
        # constant_liar: parallel workers see running trials as bad ones and do not all propose the same point
        return TPESampler(n_startup_trials=n_startup_trials, seed=seed, constant_liar=True)
    if name == "random":
        return RandomSampler(seed=seed)
    if name == "cmaes":
        try:
            import cmaes  # noqa: F401
        except ModuleNotFoundError:
            raise UserError("--sampler cmaes needs the cmaes package: pip install cmaes") from None
        # CMA-ES handles numbers only; categorical parameters are drawn by an independent TPE sampler
        independent = TPESampler(n_startup_trials=n_startup_trials, seed=seed)
        return CmaEsSampler(
            n_startup_trials=n_startup_trials, seed=seed, independent_sampler=independent, warn_independent_sampling=False
        )
    raise UserError(f"unknown sampler {name!r}; choose one of: {', '.join(SAMPLERS)}")


def make_pruner(name: str, n_startup_trials: int, n_evaluations: int) -> BasePruner:
    """
    :param name: ``median``, ``halving`` or ``none``
    :param n_startup_trials: trials that complete before the median pruner acts
    :param n_evaluations: evaluations per trial (the median pruner waits for the first third of them)
    :return: the pruner
    """
    if name == "median":
        return MedianPruner(n_startup_trials=n_startup_trials, n_warmup_steps=n_evaluations // 3)
    if name == "halving":
        return SuccessiveHalvingPruner(min_resource=1, reduction_factor=4, min_early_stopping_rate=0)
    if name == "none":
        return NopPruner()
    raise UserError(f"unknown pruner {name!r}; choose one of: {', '.join(PRUNERS)}")


def quiet_optuna(verbose: int) -> None:
    """Our own progress lines replace Optuna's per-trial log unless ``verbose >= 2``."""
    optuna.logging.set_verbosity(optuna.logging.INFO if verbose >= 2 else optuna.logging.ERROR)
