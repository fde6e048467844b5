"""Checks of hyperparameter names and values before a model is built, so bad input gets one clear line."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from sb3_speedups.errors import UserError

_NOT_KWARGS = {"self", "policy", "env", "_init_setup_model", "support_multi_env", "supported_action_spaces", "sde_support"}


def accepted_kwargs(cls: type) -> set[str]:
    """
    Constructor keyword names of an algorithm class, following ``**kwargs`` up the MRO (our subclasses add
    keyword-only options and pass the rest on to SB3).

    :param cls: algorithm class
    :return: the accepted names
    """
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names.update(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names - _NOT_KWARGS


def _number(low: float | None = None, high: float | None = None, integer: bool = False, low_open: bool = False):
    kind = "an integer" if integer else "a number"
    lo = "" if low is None else (f" > {low}" if low_open else f" >= {low}")
    hi = "" if high is None else f" <= {high}"
    rule = f"{kind}{lo}{' and' if lo and hi else ''}{hi}"

    def check(value: Any) -> str | None:
        if callable(value) and not integer:
            return None  # a schedule; checked by SB3 when called
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
            return rule
        if low is not None and (value <= low if low_open else value < low):
            return rule
        if high is not None and value > high:
            return rule
        return None

    return check


def _ent_coef(value: Any) -> str | None:
    """SAC's and TQC's ``"auto"`` / ``"auto_<initial value>"`` (learned), else a number >= 0."""
    if isinstance(value, str) and value.startswith("auto"):
        initial = value[len("auto_") :] if value.startswith("auto_") else "1.0"
        try:
            ok = value in ("auto", f"auto_{initial}") and float(initial) > 0
        except ValueError:
            ok = False
        return None if ok else "a number >= 0, 'auto' or 'auto_<initial value > 0>'"
    return _number(0)(value)


def _gradient_steps(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= 1)
    return None if ok else "an integer >= 1, or -1 (as many as env steps)"


def _train_freq(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], int) and value[1] in ("step", "episode"):
        return None
    return "an integer >= 1, or [n, 'step'|'episode']"


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "learning_rate": _number(0, low_open=True),
    "gamma": _number(0, 1),
    "gae_lambda": _number(0, 1),
    "n_steps": _number(1, integer=True),
    "batch_size": _number(1, integer=True),
    "n_epochs": _number(1, integer=True),
    "clip_range": _number(0, low_open=True),
    "ent_coef": _ent_coef,
    "vf_coef": _number(0),
    "max_grad_norm": _number(0, low_open=True),
    "buffer_size": _number(1, integer=True),
    "learning_starts": _number(0, integer=True),
    "tau": _number(0, 1),
    "target_update_interval": _number(1, integer=True),
    "exploration_fraction": _number(0, 1),
    "exploration_initial_eps": _number(0, 1),
    "exploration_final_eps": _number(0, 1),
    "gradient_steps": _gradient_steps,
    "train_freq": _train_freq,
}


def validate_model_kwargs(cls: type, kwargs: dict[str, Any], algo: str) -> None:
    """
    Raise :class:`UserError` for an unknown hyperparameter (with close matches) or a value out of range.

    :param cls: the algorithm class that will receive ``kwargs``
    :param kwargs: constructor keyword arguments from the YAML file and ``-params``
    :param algo: algorithm name for messages
    """
    accepted = accepted_kwargs(cls)
    for key, value in kwargs.items():
        if key == "policy":
            continue
        if key not in accepted:
            close = difflib.get_close_matches(key, sorted(accepted), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"valid names: {', '.join(sorted(accepted))}"
            raise UserError(f"unknown hyperparameter {key!r} for {algo} ({cls.__name__}); {hint}")
        check = CHECKS.get(key)
        problem = check(value) if check is not None else None
        if key == "ent_coef" and isinstance(value, str) and problem is None and "target_entropy" not in accepted:
            problem = f"a number >= 0 ({cls.__name__} learns no entropy coefficient)"
        if problem is not None:
            raise UserError(f"invalid hyperparameter {key}={value!r} for {algo}: expected {problem}")
