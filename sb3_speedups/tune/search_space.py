"""
Search spaces: which hyperparameters a trial samples, and how the sampled values become RL-Zoo hyperparameters.

A space is a mapping of names to distributions (:class:`Param`) plus fixed values. Names are hyperparameter
names with three small conventions, so that spaces stay plain data (and YAML files can extend them):

- ``one_minus_gamma``: sampled on ``1 - gamma`` (log scale near 1), written as ``gamma``;
- ``learning_rate_schedule: linear``: turns the sampled ``learning_rate`` into ``lin_<value>``;
- ``policy_kwargs.net_arch``: a dotted name sets a key of a nested mapping; a ``net_arch`` string such as
  ``"64x64"`` becomes ``[64, 64]``.

The built-in spaces are in :mod:`sb3_speedups.tune.spaces`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from sb3_speedups.errors import UserError
from sb3_speedups.registry import import_object
from sb3_speedups.zoo.hyperparams import ZOO_KEYS, load_yaml_file
from sb3_speedups.zoo.kwargs_parser import parse_kwargs_string
from sb3_speedups.zoo.validation import accepted_kwargs

Constraint = Callable[[dict[str, Any]], None]
ONE_MINUS = "one_minus_"
SCHEDULE_SUFFIX = "_schedule"


@dataclass(frozen=True)
class Param:
    """
    One sampled hyperparameter: a list of choices, or a numeric range.

    :param name: name in the space (see the module docstring)
    :param choices: categorical values (``None``, bool, int, float or str)
    :param low: lower bound of a range
    :param high: upper bound of a range
    :param log: sample the range on a log scale
    :param integer: sample integers
    :param step: discretisation step of the range
    """

    name: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    step: float | None = None

    def suggest(self, trial: optuna.Trial) -> Any:
        """:return: the trial's value for this parameter"""
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        assert self.low is not None and self.high is not None
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def to_yaml(self) -> Any:
        """:return: the YAML form read by :func:`parse_param`"""
        if self.choices is not None:
            return list(self.choices)
        spec: dict[str, Any] = {"low": self.low, "high": self.high}
        if self.log:
            spec["log"] = True
        if self.step is not None:
            spec["step"] = self.step
        if self.integer and not (isinstance(self.low, int) and isinstance(self.high, int)):
            spec["int"] = True
        return spec


@dataclass
class SearchSpace:
    """
    :param params: sampled parameters by name
    :param fixed: values set in every trial without sampling (same naming conventions)
    :param constraints: fix-ups of the merged hyperparameters that keep a combination valid
        (e.g. a minibatch no larger than the rollout); they belong to the algorithm and survive ``replace``
    """

    params: dict[str, Param] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    constraints: list[Constraint] = field(default_factory=list)

    def sample(self, trial: optuna.Trial) -> dict[str, Any]:
        """:return: hyperparameters (RL-Zoo form, nested mappings for dotted names) for ``trial``"""
        values = dict(self.fixed)
        values.update({name: param.suggest(trial) for name, param in self.params.items()})
        return to_hyperparams(values)

    def to_yaml(self) -> dict[str, Any]:
        """:return: this space as a search-space file (``replace: true``, so it stands on its own)"""
        params: dict[str, Any] = {name: param.to_yaml() for name, param in self.params.items()}
        for name, value in self.fixed.items():
            params[name] = {"value": value} if isinstance(value, (list, dict)) else value
        return {"replace": True, "params": params}


def _as_number(value: Any, name: str, key: str) -> float:
    if isinstance(value, str):  # PyYAML reads 1e-5 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"search space: {name}.{key} must be a number, got {value!r}")
    return value


def parse_param(name: str, spec: Any) -> Param | None:
    """
    :param name: parameter name
    :param spec: ``[a, b]`` (choices), ``{low, high, log?, step?, int?}`` (range), ``{value: x}`` or a scalar (fixed)
    :return: the parameter, or ``None`` for a fixed value
    """
    if isinstance(spec, list):
        if not spec:
            raise UserError(f"search space: {name} has an empty list of choices; give at least one value")
        if any(not (v is None or isinstance(v, (bool, int, float, str))) for v in spec):
            raise UserError(f"search space: choices of {name} must be scalars (write lists as strings, e.g. '64x64')")
        return Param(name, choices=tuple(spec))
    if not isinstance(spec, dict) or "value" in spec:
        return None
    unknown = set(spec) - {"low", "high", "log", "step", "int"}
    if unknown or not {"low", "high"} <= set(spec):
        raise UserError(
            f"search space: {name} must be a list of choices or a mapping with low and high (and optional log, step, int), "
            f"got {spec!r}"
        )
    low, high = _as_number(spec["low"], name, "low"), _as_number(spec["high"], name, "high")
    if not low < high:
        raise UserError(f"search space: {name} needs low < high, got low={low}, high={high}")
    integer = bool(spec.get("int", isinstance(low, int) and isinstance(high, int)))
    log = bool(spec.get("log", False))
    if log and low <= 0:
        raise UserError(f"search space: {name} has log: true, so low must be > 0 (got {low})")
    step = _as_number(spec["step"], name, "step") if spec.get("step") is not None else None
    return Param(name, low=low, high=high, log=log, integer=integer, step=step)


def apply_space_file(space: SearchSpace, path: str | Path) -> SearchSpace:
    """
    Extend (or, with ``replace: true``, replace) ``space`` with a search-space YAML file::

        replace: false            # optional: true drops the built-in parameters
        params:
          learning_rate: {low: 1.0e-4, high: 3.0e-3, log: true}
          n_epochs: [5, 10, 20]
          ent_coef: 0.0           # fixed in every trial
          vf_coef: null           # drop a built-in parameter

    :param space: the built-in space
    :param path: the YAML file
    :return: the new space
    """
    data = load_yaml_file(path)
    unknown = set(data) - {"replace", "params"}
    if unknown or not isinstance(data.get("params"), dict):
        raise UserError(
            f"search space {path}: expected the keys 'params' (a mapping) and optionally 'replace', "
            f"got {', '.join(map(str, data)) or 'nothing'}"
        )
    replace = data.get("replace", False)
    if not isinstance(replace, bool):
        raise UserError(f"search space {path}: replace must be true or false, got {replace!r}")
    params = {} if replace else dict(space.params)
    fixed = {} if replace else dict(space.fixed)
    for name, spec in data["params"].items():
        name = str(name)
        params.pop(name, None)
        fixed.pop(name, None)
        if spec is None:
            continue
        param = parse_param(name, spec)
        if param is None:
            fixed[name] = spec["value"] if isinstance(spec, dict) else spec
        else:
            params[name] = param
    return SearchSpace(params, fixed, list(space.constraints))


def _net_arch(value: Any) -> Any:
    if isinstance(value, str):
        parts = value.lower().replace(" ", "").split("x")
        if value and all(part.isdigit() for part in parts):
            return [int(part) for part in parts]
    return value


def target_key(name: str) -> str:
    """:return: the hyperparameter a space name sets (``one_minus_gamma`` -> ``gamma``)"""
    return name[len(ONE_MINUS) :] if name.startswith(ONE_MINUS) else name


def to_hyperparams(values: dict[str, Any]) -> dict[str, Any]:
    """
    Apply the naming conventions of the module docstring.

    :param values: sampled and fixed values by space name
    :return: RL-Zoo hyperparameters, dotted names as nested mappings
    """
    result: dict[str, Any] = {}
    schedules = {}
    for name, value in values.items():
        if name.endswith(SCHEDULE_SUFFIX):
            schedules[name[: -len(SCHEDULE_SUFFIX)]] = value
            continue
        key = target_key(name)
        if key != name:
            value = 1.0 - value
        if key.rpartition(".")[2] == "net_arch":
            value = _net_arch(value)
        head, _, tail = key.partition(".")
        if tail:
            result.setdefault(head, {})[tail] = value
        else:
            result[key] = value
    for key, kind in schedules.items():
        if kind == "linear" and isinstance(result.get(key), (int, float)):
            result[key] = f"lin_{result[key]}"
        elif kind not in ("linear", "constant"):
            raise UserError(f"search space: {key}{SCHEDULE_SUFFIX} must be 'linear' or 'constant', got {kind!r}")
    return result


def merge_hyperparams(base: dict[str, Any], sampled: dict[str, Any], constraints: list[Constraint]) -> dict[str, Any]:
    """
    :param base: the YAML section (with ``-params``) of the run
    :param sampled: a trial's values from :meth:`SearchSpace.sample`; nested mappings update the base's
        (an RL-Zoo ``"dict(...)"`` string is parsed first)
    :param constraints: the space's fix-ups, applied to the merged mapping
    :return: the merged hyperparameters
    """
    merged = dict(base)
    for key, value in sampled.items():
        if isinstance(value, dict):
            current = merged.get(key)
            current = parse_kwargs_string(current) if isinstance(current, str) else dict(current or {})
            merged[key] = {**current, **value}
        else:
            merged[key] = value
    for constraint in constraints:
        constraint(merged)
    return merged


def policy_class(algo_cls: type, policy: Any) -> type | None:
    """:return: the policy class that ``policy`` (an alias such as ``MlpPolicy`` or a class) names, if known"""
    if isinstance(policy, type):
        return policy
    aliases = getattr(algo_cls, "policy_aliases", {})
    if isinstance(policy, str) and policy in aliases:
        return aliases[policy]
    if isinstance(policy, str) and "." in policy:
        module, _, attr = policy.rpartition(".")
        try:
            return import_object(f"{module}:{attr}")
        except (ImportError, AttributeError):
            return None
    return None


def check_space_names(space: SearchSpace, algo_cls: type, base: dict[str, Any], algo: str) -> None:
    """
    Fail early (one line) when a space names a hyperparameter the algorithm or its policy does not accept, instead
    of failing every trial.

    :param space: the search space
    :param algo_cls: the algorithm class
    :param base: the YAML section (for the policy)
    :param algo: algorithm name for messages
    """
    model_keys = accepted_kwargs(algo_cls) | set(ZOO_KEYS) | {"policy"}
    policy_cls = policy_class(algo_cls, base.get("policy"))
    names = list(space.params) + list(space.fixed)
    for name in names:
        if name.endswith(SCHEDULE_SUFFIX):
            if name[: -len(SCHEDULE_SUFFIX)] not in names:
                raise UserError(f"search space: {name} needs {name[: -len(SCHEDULE_SUFFIX)]} in the space too")
            continue
        head, _, tail = target_key(name).partition(".")
        if head not in model_keys:
            raise UserError(f"search space: {algo} ({algo_cls.__name__}) has no hyperparameter {head!r} (from {name!r})")
        extra: frozenset[str] = getattr(algo_cls, "extra_policy_kwargs", frozenset())
        if head == "policy_kwargs" and tail and policy_cls is not None and tail not in accepted_kwargs(policy_cls) | extra:
            raise UserError(f"search space: policy {policy_cls.__name__} has no keyword {tail!r} (from {name!r})")
