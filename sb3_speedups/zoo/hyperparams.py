"""
Reading RL-Zoo-format hyperparameter files.

Small functions, each testable on its own: find the file, load the YAML, pick the env's section, merge
overrides, then :func:`preprocess_hyperparams` turns the raw mapping into what the model constructor and the
env factory need.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.resources
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sb3_speedups.common.schedules import ConstantSchedule, LinearSchedule
from sb3_speedups.errors import UserError
from sb3_speedups.zoo.kwargs_parser import parse_kwargs_string

# Keys the RL Zoo reads itself; everything else goes to the model constructor.
ZOO_KEYS = (
    "n_timesteps", "n_envs", "normalize", "normalize_kwargs", "env_wrapper", "vec_env_wrapper", "frame_stack",
    "callback", "env_kwargs", "monitor_kwargs", "noise_type", "noise_std",
)  # fmt: skip
SCHEDULE_KEYS = ("learning_rate", "clip_range", "clip_range_vf", "delta_std")
# Only our PPO takes schedules for these, so numbers stay numbers and only ``lin_`` strings become schedules.
STRING_SCHEDULE_KEYS = ("gamma", "gae_lambda")


def bundled_hyperparams_dir() -> Path:
    """
    :return: the folder of the hyperparameter files shipped with the package (the checkout's ``hyperparams/``
        when running from a source tree, which is the source of truth)
    """
    packaged = importlib.resources.files("sb3_speedups") / "hyperparams"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "hyperparams"


def rl_zoo_hyperparams_dir() -> Path | None:
    """
    :return: the RL Zoo's ``hyperparams/`` folder when ``rl_zoo3`` is installed, found without importing it
        (importing ``rl_zoo3`` patches gymnasium's ``TimeLimit`` for the whole process)
    """
    spec = importlib.util.find_spec("rl_zoo3")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "hyperparams"
    return folder if folder.is_dir() else None


def default_hyperparams_file(algo: str) -> Path:
    """
    :param algo: RL-Zoo algorithm name
    :return: our bundled file for it, else the RL Zoo's own file when ``rl_zoo3`` is installed
    """
    ours = bundled_hyperparams_dir() / f"{algo}.yml"
    if ours.is_file():
        return ours
    zoo = rl_zoo_hyperparams_dir()
    if zoo is not None and (zoo / f"{algo}.yml").is_file():
        return zoo / f"{algo}.yml"
    raise UserError(f"no bundled hyperparameters for {algo!r}; pass --conf-file with an RL-Zoo-format YAML file")


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """
    :param path: a YAML file
    :return: its top-level mapping
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read hyperparameters file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"malformed YAML in {where}: {problem}; fix the file's syntax") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping of env ids to hyperparameters, not {type(data).__name__}")
    return data


def select_env_section(all_hyperparams: dict[str, Any], env_id: str, source: str, is_atari: bool = False) -> dict[str, Any]:
    """
    Pick the section for ``env_id``, falling back to ``atari`` (for Atari envs) then ``default`` as the RL Zoo does.

    :param all_hyperparams: the file's mapping
    :param env_id: the environment id
    :param source: file name for error messages
    :param is_atari: whether the env is an Atari env
    :return: a copy of the section
    """
    for key in (env_id, "atari" if is_atari else None, "default"):
        if key is not None and key in all_hyperparams:
            section = all_hyperparams[key] or {}
            if not isinstance(section, dict):
                raise UserError(f"section {key!r} in {source} must be a mapping of hyperparameters")
            return dict(section)
    close = difflib.get_close_matches(env_id, [str(k) for k in all_hyperparams], n=3)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise UserError(f"no hyperparameters for {env_id} in {source}{hint}; add a section for it or a 'default:' section")


def parse_value(text: str) -> Any:
    """
    Parse a command-line value as a YAML scalar/collection, else a Python literal, else keep the string.

    :param text: e.g. ``"0.99"``, ``"[64, 64]"``, ``"lin_1e-3"``, ``"dict(net_arch=[8])"``
    :return: the value
    """
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if isinstance(value, str):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    return value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """
    :param items: ``["key:value", ...]`` as given to ``-params``
    :return: the parsed mapping
    """
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or not key:
            raise UserError(f"bad -params item {item!r}: write key:value, e.g. learning_rate:0.001")
        overrides[key.strip()] = parse_value(value.strip())
    return overrides


def read_hyperparams(
    algo: str,
    env_id: str,
    conf_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    is_atari: bool = False,
) -> dict[str, Any]:
    """
    The raw merged hyperparameters for one run (what ``config.yml`` records).

    :param algo: RL-Zoo algorithm name
    :param env_id: environment id
    :param conf_file: YAML file to read instead of the bundled one
    :param overrides: values that replace the file's (``-params``)
    :param is_atari: whether to fall back to the ``atari`` section
    :return: the merged mapping
    """
    path = Path(conf_file) if conf_file else default_hyperparams_file(algo)
    hyperparams = select_env_section(load_yaml_file(path), env_id, str(path), is_atari)
    hyperparams.update(overrides or {})
    return hyperparams


def parse_schedule(key: str, value: Any) -> Any:
    """
    ``lin_0.001`` -> :class:`LinearSchedule`, a number -> :class:`ConstantSchedule` (negative numbers pass through:
    they mean "disabled" for ``clip_range_vf``).

    :param key: hyperparameter name, for errors
    :param value: the YAML value
    :return: a picklable schedule, or the value itself
    """
    if isinstance(value, str):
        kind, _, initial = value.partition("_")
        try:
            initial_value = float(initial)
        except ValueError:
            initial_value = None
        if kind != "lin" or initial_value is None:
            raise UserError(f"invalid {key} {value!r}: use a number or a linear schedule such as lin_0.001")
        return LinearSchedule(initial_value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if value is None or callable(value):
            return value
        raise UserError(f"invalid {key} {value!r}: use a number or a linear schedule such as lin_0.001")
    return value if value < 0 else ConstantSchedule(float(value))


def _import_dotted(name: str, what: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UserError(f"cannot import {what} {name!r} ({exc}); give a dotted path such as package.module.Class") from None


def parse_class_list(value: Any, key: str) -> list[tuple[Any, dict[str, Any]]]:
    """
    ``env_wrapper``/``vec_env_wrapper``/``callback`` entries: a dotted name, or a list of dotted names each with
    optional kwargs (``- module.Class: {kwarg: value}``).

    :param value: the YAML value
    :param key: hyperparameter name, for errors
    :return: ``[(class, kwargs), ...]``
    """
    if value is None:
        return []
    entries = value if isinstance(value, list) else [value]
    result = []
    for entry in entries:
        kwargs: dict[str, Any] = {}
        if isinstance(entry, dict):
            if len(entry) != 1:
                raise UserError(
                    f"each {key} entry must be one 'dotted.Name: {{kwargs}}' mapping, got {entry!r}; check indentation"
                )
            entry, kwargs = next(iter(entry.items()))
            kwargs = dict(kwargs or {})
        result.append((_import_dotted(entry, key) if isinstance(entry, str) else entry, kwargs))
    return result


@dataclass
class Hyperparams:
    """
    Preprocessed hyperparameters of one run.

    :param n_timesteps: training budget
    :param n_envs: number of parallel training envs
    :param model_kwargs: everything for the algorithm constructor (``policy`` included)
    :param normalize: whether to wrap the envs in ``VecNormalize``
    :param normalize_kwargs: its keyword arguments
    :param env_wrappers: ``[(wrapper class, kwargs)]`` applied to each env in order
    :param vec_env_wrappers: ``[(VecEnvWrapper class, kwargs)]``
    :param frame_stack: ``VecFrameStack`` size, or ``None``
    :param callbacks: ``[(callback class, kwargs)]``
    :param env_kwargs: keyword arguments of ``gym.make``
    :param monitor_kwargs: keyword arguments of ``Monitor``
    :param noise: ``(noise_type, noise_std)`` for off-policy continuous control, or ``None``
    """

    n_timesteps: int
    n_envs: int = 1
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    normalize: bool = False
    normalize_kwargs: dict[str, Any] = field(default_factory=dict)
    env_wrappers: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    vec_env_wrappers: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    frame_stack: int | None = None
    callbacks: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    monitor_kwargs: dict[str, Any] = field(default_factory=dict)
    noise: tuple[str, float] | None = None


def _as_mapping(value: Any, key: str) -> dict[str, Any]:
    if isinstance(value, str):
        value = parse_kwargs_string(value)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{key} must be a mapping (or a 'dict(...)' string), got {value!r}")
    return dict(value)


def _resolve_class_paths(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Our own YAML may give real mappings with dotted class paths (``activation_fn: torch.nn.ReLU``)."""
    resolved = {}
    for key, value in kwargs.items():
        if isinstance(value, str) and (key.endswith(("_fn", "_class")) or key == "features_extractor_class"):
            value = _import_dotted(value if "." in value else f"torch.nn.{value}", key)
        elif isinstance(value, dict):
            value = _resolve_class_paths(value)
        resolved[key] = value
    return resolved


def _preprocess_model_kwargs(hp: dict[str, Any]) -> dict[str, Any]:
    """Schedules, ``train_freq`` tuples, kwargs strings and dotted class names of the constructor arguments."""
    for key in SCHEDULE_KEYS:
        if key in hp:
            hp[key] = parse_schedule(key, hp[key])
    for key in STRING_SCHEDULE_KEYS:
        if isinstance(hp.get(key), str):
            hp[key] = parse_schedule(key, hp[key])
    if isinstance(hp.get("train_freq"), list):
        hp["train_freq"] = tuple(hp["train_freq"])
    for key in ("policy_kwargs", "replay_buffer_kwargs"):
        if key in hp:
            hp[key] = _resolve_class_paths(_as_mapping(hp[key], key))
    if isinstance(hp.get("replay_buffer_class"), str):
        name = hp["replay_buffer_class"]
        hp["replay_buffer_class"] = _import_dotted(name, "replay_buffer_class") if "." in name else parse_kwargs_string(name)
    if isinstance(hp.get("policy"), str) and "." in hp["policy"]:
        hp["policy"] = _import_dotted(hp["policy"], "policy")
    return {key: value for key, value in hp.items() if key not in ZOO_KEYS}


def _preprocess_normalize(raw: dict[str, Any], result: Hyperparams) -> None:
    normalize = raw.get("normalize", False)
    if isinstance(normalize, (str, dict)):
        result.normalize, result.normalize_kwargs = True, _as_mapping(normalize, "normalize")
    else:
        result.normalize = bool(normalize)
    result.normalize_kwargs.update(_as_mapping(raw.get("normalize_kwargs"), "normalize_kwargs"))
    if result.normalize and isinstance(raw.get("gamma"), (int, float)):
        # as the RL Zoo: the return normalisation discounts like the algorithm
        result.normalize_kwargs["gamma"] = float(raw["gamma"])


def _parse_budget(raw: dict[str, Any], n_timesteps: int | None) -> int:
    budget = n_timesteps if n_timesteps is not None and n_timesteps > 0 else raw.get("n_timesteps")
    if budget is None:
        raise UserError("n_timesteps is missing: set it in the YAML section or pass -n/--n-timesteps")
    try:
        value = int(float(budget))
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise UserError(f"invalid n_timesteps {budget!r}: expected a positive integer")
    return value


def preprocess_hyperparams(raw: dict[str, Any], n_timesteps: int | None = None) -> Hyperparams:
    """
    Turn a raw RL-Zoo section into constructor kwargs plus env settings, as the RL Zoo does.

    :param raw: the merged section (not modified)
    :param n_timesteps: budget that replaces the file's ``n_timesteps`` when given and positive
    :return: the preprocessed hyperparameters
    """
    n_envs = raw.get("n_envs", 1)
    if isinstance(n_envs, bool) or not isinstance(n_envs, int) or n_envs < 1:
        raise UserError(f"invalid n_envs {n_envs!r}: expected an integer >= 1")
    result = Hyperparams(n_timesteps=_parse_budget(raw, n_timesteps), n_envs=n_envs)
    _preprocess_normalize(raw, result)
    result.env_wrappers = parse_class_list(raw.get("env_wrapper"), "env_wrapper")
    result.vec_env_wrappers = parse_class_list(raw.get("vec_env_wrapper"), "vec_env_wrapper")
    result.callbacks = parse_class_list(raw.get("callback"), "callback")
    result.frame_stack = raw.get("frame_stack")
    result.env_kwargs = _as_mapping(raw.get("env_kwargs"), "env_kwargs")
    result.monitor_kwargs = _as_mapping(raw.get("monitor_kwargs"), "monitor_kwargs")
    if raw.get("noise_type") is not None:
        result.noise = (str(raw["noise_type"]).strip(), float(raw.get("noise_std", 0.1)))
    result.model_kwargs = _preprocess_model_kwargs(dict(raw))
    return result
