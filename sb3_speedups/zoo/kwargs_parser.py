"""
Safe parser for the RL Zoo's Python-literal strings (``policy_kwargs: "dict(net_arch=[64, 64], activation_fn=nn.ReLU)"``).

The RL Zoo passes these strings to ``eval``; we accept only literals, ``dict(...)``/``list``/``tuple`` calls,
containers, unary minus and a whitelist of names (activation functions, SB3 feature extractors, optimizers,
replay buffers). Anything else (attribute access outside the whitelist, other calls, lambdas, comprehensions,
dunder tricks) raises :class:`~sb3_speedups.errors.UserError`.
"""

from __future__ import annotations

import ast
import importlib
from functools import cache
from typing import Any

from sb3_speedups.errors import UserError

_ACTIVATIONS = (
    "ReLU", "Tanh", "ELU", "GELU", "SELU", "SiLU", "LeakyReLU", "Sigmoid", "Softplus", "Mish", "Hardswish",
    "Hardtanh", "PReLU", "CELU", "Identity", "Softsign", "Tanhshrink", "LogSigmoid", "ReLU6",
)  # fmt: skip
_OPTIMIZERS = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam")
# name -> "module:attribute", resolved lazily so that parsing does not import sb3_contrib unless needed
_NAMED_OBJECTS = {
    "NatureCNN": "stable_baselines3.common.torch_layers:NatureCNN",
    "FlattenExtractor": "stable_baselines3.common.torch_layers:FlattenExtractor",
    "CombinedExtractor": "stable_baselines3.common.torch_layers:CombinedExtractor",
    "HerReplayBuffer": "stable_baselines3:HerReplayBuffer",
    "ReplayBuffer": "stable_baselines3.common.buffers:ReplayBuffer",
    "PrioritizedReplayBuffer": "sb3_speedups.dqn.replay.buffers:PrioritizedReplayBuffer",
    "RMSpropTFLike": "stable_baselines3.common.sb2_compat.rmsprop_tf_like:RMSpropTFLike",
}
_CONSTANTS = {"True": True, "False": False, "None": None}
_CONTAINER_CALLS = {"dict": dict, "list": list, "tuple": tuple}


@cache
def _whitelist() -> dict[str, str]:
    names: dict[str, str] = {}
    for prefix in ("nn", "th.nn", "torch.nn"):
        for act in _ACTIVATIONS:
            names[f"{prefix}.{act}"] = f"torch.nn:{act}"
    for prefix in ("th.optim", "torch.optim", "optim"):
        for opt in _OPTIMIZERS:
            names[f"{prefix}.{opt}"] = f"torch.optim:{opt}"
    for name, target in _NAMED_OBJECTS.items():
        names[name] = target
        module, attr = target.split(":")
        names[f"{module}.{attr}"] = target
    return names


def resolve_name(dotted: str) -> Any:
    """
    Resolve a whitelisted name (``nn.ReLU``, ``NatureCNN``) to the object it names.

    :param dotted: the name as written in the YAML string
    :return: the object
    """
    target = _whitelist().get(dotted)
    if target is None:
        raise UserError(
            f"name {dotted!r} is not allowed in a kwargs string; use one of: nn.<Activation>, th.optim.<Optimizer>, "
            f"{', '.join(sorted(_NAMED_OBJECTS))} (or a real YAML mapping with a dotted class path)"
        )
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def _dotted_name(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


class _Evaluator:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, node: ast.AST, what: str) -> UserError:
        snippet = ast.get_source_segment(self.source, node) or type(node).__name__
        return UserError(
            f"{what} in kwargs string {self.source.strip()!r}: {snippet!r} is not allowed "
            "(only literals, dict(...), lists, tuples and whitelisted names such as nn.ReLU)"
        )

    def eval(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Dict):
            if any(key is None for key in node.keys):
                raise self.fail(node, "dict unpacking")
            return {self.eval(k): self.eval(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
        if isinstance(node, ast.List):
            return [self.eval(elt) for elt in node.elts]
        if isinstance(node, ast.Tuple):
            return tuple(self.eval(elt) for elt in node.elts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.eval(node.operand)
            if not isinstance(value, (int, float)):
                raise self.fail(node, "unary operator on a non-number")
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.Call):
            return self.eval_call(node)
        if isinstance(node, (ast.Name, ast.Attribute)):
            dotted = _dotted_name(node)
            if dotted is None:
                raise self.fail(node, "expression")
            if dotted in _CONSTANTS:
                return _CONSTANTS[dotted]
            if dotted not in _whitelist():
                raise self.fail(node, "unknown name")
            return resolve_name(dotted)
        raise self.fail(node, "expression")

    def eval_call(self, node: ast.Call) -> Any:
        func = node.func.id if isinstance(node.func, ast.Name) else None
        if func not in _CONTAINER_CALLS:
            raise self.fail(node, "function call")
        if func == "dict":
            if node.args:
                if len(node.args) != 1 or not isinstance(node.args[0], ast.Dict):
                    raise self.fail(node, "positional argument to dict()")
                result = self.eval(node.args[0])
            else:
                result = {}
            for keyword in node.keywords:
                if keyword.arg is None:
                    raise self.fail(node, "** unpacking")
                result[keyword.arg] = self.eval(keyword.value)
            return result
        if node.keywords or len(node.args) > 1:
            raise self.fail(node, f"arguments to {func}()")
        return _CONTAINER_CALLS[func](self.eval(node.args[0]) if node.args else ())


def parse_kwargs_string(source: str) -> Any:
    """
    Parse an RL-Zoo-style Python literal string safely.

    :param source: e.g. ``"dict(net_arch=[64, 64], activation_fn=nn.ReLU)"`` or ``"{'norm_obs': False}"``
    :return: the value (usually a dict)
    """
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        raise UserError(f"cannot parse kwargs string {source.strip()!r}: {exc.msg}") from None
    return _Evaluator(source.strip()).eval(tree.body)
