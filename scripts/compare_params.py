"""
Prove that a refactor changes no number: train fixed-seed cases with two source trees (two commits) on one machine and
compare the parameters bit for bit. Run both dumps on the same machine: bit-equality across machines or CPU kinds is
not expected (the same code may round differently on AVX-512 and AVX2 code paths), so a dump is not a baseline for
another machine.

- ``python scripts/compare_params.py dump --tree DIR --out FILE.npz [--cases ...]``: train each case in a fresh
  subprocess that imports ``sb3_speedups`` from ``DIR``; save the policy's ``state_dict``, the optimizer's state
  (and the ``VecNormalize`` statistics, where the config normalises) as ``case/name`` arrays in one ``.npz``.
- ``python scripts/compare_params.py compare A.npz B.npz [--cases ...]``: per case, the number of arrays, whether the
  key sets match and the largest absolute difference; exit code 0 iff every array is bit-identical.
- ``python scripts/compare_params.py run (--old DIR | --baseline FILE) --new DIR [--cases ...]``: dump, then compare.

Each case reads its section of the tree's own ``hyperparams/*.yml`` with the tree's own ``zoo`` functions (the CLI's
``prepare_experiment`` -> ``make_env`` -> ``create_model``), without evaluation or files, on the CPU. The subprocess
environment is pinned (no ``*_NUM_THREADS`` variables, ``PYTHONHASHSEED=0``) so that the package picks its own
torch thread counts, as it does for a user who set none.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SEED = 0
META = "_meta"  # key prefix of the provenance strings (not compared)
# These would count as the user's choice and switch off the package's own thread defaults.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")


@dataclass(frozen=True)
class Case:
    """
    One fixed-seed training run.

    :param name: key prefix in the ``.npz``
    :param algo: RL-Zoo algorithm name
    :param env_id: gymnasium id (its section of ``conf_file`` is used)
    :param conf_file: hyperparameters file, relative to the tree
    :param n_timesteps: training budget (replaces the file's)
    :param overrides: values that replace the file's (as ``-params``)
    """

    name: str
    algo: str
    env_id: str
    conf_file: str
    n_timesteps: int
    overrides: dict[str, Any] = field(default_factory=dict)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("ppo_cartpole_split_auto", "ppo", "CartPole-v1", "hyperparams/ppo.yml", 20_000),
        Case("ppo_cartpole_split_false", "ppo", "CartPole-v1", "hyperparams/ppo.yml", 20_000, {"split_update": False}),
        Case("dqn_cartpole", "dqn", "CartPole-v1", "hyperparams/dqn.yml", 10_000),
        Case("dqn_fast_cartpole", "dqn", "CartPole-v1", "hyperparams/dqn_fast.yml", 10_000),
        Case("ppo_lstm_novel_lstm", "ppo_lstm", "CartPoleNoVel-v1", "hyperparams/ppo_lstm.yml", 8_000),
        Case(
            "ppo_lstm_novel_gru", "ppo_lstm", "CartPoleNoVel-v1", "hyperparams/ppo_lstm.yml", 8_000, {"policy": "MlpGruPolicy"}
        ),
        Case("sac_pendulum", "sac", "Pendulum-v1", "hyperparams/sac.yml", 1_000),
        Case("td3_pendulum", "td3", "Pendulum-v1", "hyperparams/td3.yml", 1_000, {"learning_starts": 500}),
        Case("ddpg_pendulum", "ddpg", "Pendulum-v1", "hyperparams/ddpg.yml", 1_000, {"learning_starts": 500}),
        Case("a2c_cartpole", "a2c", "CartPole-v1", "hyperparams/a2c.yml", 20_000),
        Case("a2c_cartpole_adam", "a2c", "CartPole-v1", "hyperparams/a2c.yml", 10_000, {"use_rms_prop": False}),
        Case("a2c_lunarlander", "a2c", "LunarLander-v3", "hyperparams/a2c.yml", 10_000),
        Case("ppo_mask_invalid_discrete", "ppo_mask", "InvalidActionEnvDiscrete-v0", "hyperparams/ppo_mask.yml", 10_000),
        Case(
            "ppo_mask_invalid_multidiscrete",
            "ppo_mask",
            "InvalidActionEnvMultiDiscrete-v0",
            "hyperparams/ppo_mask.yml",
            10_000,
        ),
        Case("ppo_mask_knapsack", "ppo_mask", "MaskedKnapsack-v0", "hyperparams/ppo_mask.yml", 10_000),
        Case("tqc_pendulum", "tqc", "Pendulum-v1", "hyperparams/tqc.yml", 1_000),
        Case("qrdqn_cartpole", "qrdqn", "CartPole-v1", "hyperparams/qrdqn.yml", 10_000),
        Case("crossq_pendulum", "crossq", "Pendulum-v1", "hyperparams/crossq.yml", 1_000),
        # pixels (ale-py): two PPO rollouts of 8 envs x 128 steps; 20 A2C updates of 16 envs x 5 steps
        Case("ppo_breakout", "ppo", "BreakoutNoFrameskip-v4", "hyperparams/ppo.yml", 2_048),
        Case("a2c_breakout", "a2c", "BreakoutNoFrameskip-v4", "hyperparams/a2c.yml", 1_600),
        Case("dqn_breakout", "dqn", "BreakoutNoFrameskip-v4", "hyperparams/dqn.yml", 1_500, {"learning_starts": 1_000}),
    )
}


# ----- inside the subprocess ------------------------------------------------------------------------------------------


def check_import_location(tree: Path) -> str:
    """
    Fail unless ``sb3_speedups`` was imported from ``tree`` (the venv's editable install points elsewhere).

    :param tree: the source tree that ``PYTHONPATH`` names
    :return: ``sb3_speedups.__file__``
    """
    import sb3_speedups

    location = str(sb3_speedups.__file__)
    print(f"sb3_speedups.__file__ = {location}", flush=True)
    if not Path(location).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"sb3_speedups was imported from {location}, not from {tree}: PYTHONPATH did not win")
    return location


def as_array(value: Any) -> np.ndarray:
    """:return: a tensor or number as a numpy array (a copy, so later training cannot change it)"""
    import torch as th

    if isinstance(value, th.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.array(value)


def model_arrays(model: Any) -> dict[str, np.ndarray]:
    """
    :param model: a trained SB3 model
    :return: ``policy.<state_dict key>``, ``optimizer.<parameter>.<state key>``, ``optimizer.group<i>.lr`` and, if
        the env is normalised, ``vecnormalize.<statistic>``
    """
    policy = model.policy
    arrays = {f"policy.{key}": as_array(value) for key, value in policy.state_dict().items()}
    names = {id(param): name for name, param in policy.named_parameters()}
    # on-policy and DQN: one optimizer; SAC, TD3, DDPG: the actor's, the critic's (and SAC's entropy coefficient's)
    optimizers = {
        prefix: optimizer
        for prefix, optimizer in (
            ("optimizer", getattr(policy, "optimizer", None)),
            ("actor_optimizer", getattr(getattr(policy, "actor", None), "optimizer", None)),
            ("critic_optimizer", getattr(getattr(policy, "critic", None), "optimizer", None)),
            ("ent_coef_optimizer", getattr(model, "ent_coef_optimizer", None)),
        )
        if optimizer is not None
    }
    if getattr(model, "log_ent_coef", None) is not None:
        names[id(model.log_ent_coef)] = "log_ent_coef"
        arrays["log_ent_coef"] = as_array(model.log_ent_coef)
    for prefix, optimizer in optimizers.items():
        for group_index, group in enumerate(optimizer.param_groups):
            arrays[f"{prefix}.group{group_index}.lr"] = np.array(group["lr"])
            for param_index, param in enumerate(group["params"]):
                name = names.get(id(param), f"group{group_index}.param{param_index}")
                for key, value in optimizer.state.get(param, {}).items():
                    arrays[f"{prefix}.{name}.{key}"] = as_array(value)
    vec_normalize = model.get_vec_normalize_env()
    if vec_normalize is not None:
        for stat in ("obs_rms", "ret_rms"):
            rms = getattr(vec_normalize, stat)
            for attr in ("mean", "var", "count"):
                arrays[f"vecnormalize.{stat}.{attr}"] = np.array(getattr(rms, attr))
    return arrays


def train_case(case: Case, tree: Path) -> dict[str, np.ndarray]:
    """
    Train ``case`` with the tree's own CLI functions (no evaluation env, no callbacks but the YAML's, no files).

    :param case: the run
    :param tree: source tree (for the hyperparameters file)
    :return: the arrays of :func:`model_arrays`
    """
    # The tree's own zoo functions (imported here, after the location check): the same config as the CLI's.
    from sb3_speedups.zoo.envs import make_env
    from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment

    conf_file = tree / case.conf_file
    if not conf_file.is_file():
        raise SystemExit(f"{conf_file} does not exist: update the case's conf_file for this tree")
    config = TrainConfig(
        case.algo,
        case.env_id,
        n_timesteps=case.n_timesteps,
        seed=SEED,
        conf_file=str(conf_file),
        hyperparams=dict(case.overrides),
        eval_freq=0,
        device="cpu",
        verbose=0,
    )
    experiment = prepare_experiment(config)
    hp = experiment.hyperparams
    env = make_env(case.env_id, hp, hp.n_envs, experiment.seed, vec_env=config.vec_env)
    try:
        model = create_model(experiment, env)
        model.learn(hp.n_timesteps, callback=[cls(**kwargs) for cls, kwargs in hp.callbacks])
        return model_arrays(model)
    finally:
        env.close()


def worker(case_name: str, tree: Path, out: Path) -> None:
    """Subprocess entry point: train one case, save its arrays (unprefixed) to ``out``."""
    location = check_import_location(tree)
    arrays = train_case(CASES[case_name], tree)
    arrays[f"{META}.sb3_speedups_file"] = np.array(location)
    np.savez(out, **arrays)  # type: ignore[arg-type]


# ----- in the calling process -----------------------------------------------------------------------------------------


def tree_revision(tree: Path) -> str:
    """:return: ``git rev-parse HEAD`` of ``tree``, ``+dirty`` when tracked files differ from it"""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if status else "")


def subprocess_env(tree: Path) -> dict[str, str]:
    """:return: the environment of a case's subprocess: ``tree`` alone on ``PYTHONPATH``, pinned hashing and threads"""
    env = {key: value for key, value in os.environ.items() if key not in THREAD_ENV_VARS}
    env.update(PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    return env


def dump(tree: Path, out: Path, case_names: list[str]) -> None:
    """
    Train every case in its own subprocess importing ``tree``; write all arrays as ``case/name`` into ``out``.

    :param tree: source tree to import ``sb3_speedups`` from
    :param out: the ``.npz`` to write
    :param case_names: cases to run
    """
    tree = tree.resolve()
    revision = tree_revision(tree)
    print(f"dump {tree} ({revision}) -> {out}", flush=True)
    merged: dict[str, np.ndarray] = {f"{META}/tree": np.array(str(tree)), f"{META}/revision": np.array(revision)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in case_names:
            part = Path(tmp) / f"{name}.npz"
            command = [sys.executable, str(Path(__file__).resolve()), "worker", name, "--tree", str(tree), "--out", str(part)]
            start = time.perf_counter()
            result = subprocess.run(command, cwd=tree, env=subprocess_env(tree))
            seconds = time.perf_counter() - start
            if result.returncode != 0:
                raise SystemExit(f"case {name} failed (exit code {result.returncode}) with {tree}")
            with np.load(part) as arrays:
                for key in arrays.files:
                    meta_key = key.removeprefix(f"{META}.")
                    merged[f"{name}/{key}" if meta_key == key else f"{META}/{name}.{meta_key}"] = arrays[key]
            print(f"  {name}: {seconds:.1f} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name first, so that an interrupted dump never leaves a partial baseline.
    partial = out.with_name(out.name + ".partial.npz")
    np.savez(partial, **merged)  # type: ignore[arg-type]
    partial.replace(out)


def load_cases(path: Path) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, str]]:
    """:return: the arrays of a dump grouped by case, and its provenance strings"""
    cases: dict[str, dict[str, np.ndarray]] = {}
    meta: dict[str, str] = {}
    with np.load(path) as data:
        for key in data.files:
            case, _, name = key.partition("/")
            if case == META:
                meta[name] = str(data[key])
            else:
                cases.setdefault(case, {})[name] = data[key]
    return cases, meta


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """:return: the largest absolute difference (``inf`` when shapes or dtypes differ, ``0.0`` for empty arrays)"""
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def compare(path_a: Path, path_b: Path, case_names: list[str] | None = None) -> bool:
    """
    Print, per case, the array count, whether the key sets match and the largest absolute difference.

    :param path_a: one dump
    :param path_b: the other
    :param case_names: cases to compare (default: all cases in either file)
    :return: whether every compared case has the same keys and bit-identical arrays
    """
    cases_a, meta_a = load_cases(path_a)
    cases_b, meta_b = load_cases(path_b)
    for label, path, meta in (("A", path_a, meta_a), ("B", path_b, meta_b)):
        print(f"{label}: {path} (tree {meta.get('tree', '?')}, revision {meta.get('revision', '?')})")
    present = set(cases_a) | set(cases_b)
    names = case_names or [*(name for name in CASES if name in present), *sorted(present - set(CASES))]
    all_equal = True
    print(f"{'case':<28} {'arrays A/B':>10} {'keys':>5} {'max |A-B|':>11}  result")
    for name in names:
        a, b = cases_a.get(name), cases_b.get(name)
        if a is None or b is None:
            print(f"{name:<28} {'missing in ' + ('A' if a is None else 'B'):>29}  DIFFERENT")
            all_equal = False
            continue
        common = sorted(set(a) & set(b))
        keys_match = set(a) == set(b)
        worst = max((max_abs_diff(a[key], b[key]) for key in common), default=0.0)
        # Bitwise, so that NaN in the same place is equal and -0.0 vs 0.0 is not.
        identical = keys_match and all(
            a[key].dtype == b[key].dtype and a[key].shape == b[key].shape and a[key].tobytes() == b[key].tobytes()
            for key in common
        )
        all_equal = all_equal and identical
        counts, keys = f"{len(a)}/{len(b)}", "same" if keys_match else "DIFF"
        print(f"{name:<28} {counts:>10} {keys:>5} {worst:>11.3g}  {'identical' if identical else 'DIFFERENT'}")
        for key in sorted(set(a) ^ set(b)):
            print(f"    only in {'A' if key in a else 'B'}: {key}")
        for key in common:
            diff = max_abs_diff(a[key], b[key])
            if diff != 0.0:
                print(f"    {key}: {diff:.3g}")
    print("all identical" if all_equal else "DIFFERENCES FOUND")
    return all_equal


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    case_help = f"cases to run (default: all of {', '.join(CASES)})"

    dump_parser = commands.add_parser("dump", help="train the cases with one tree and save the parameters")
    dump_parser.add_argument("--tree", type=Path, required=True, help="source tree to import sb3_speedups from")
    dump_parser.add_argument("--out", type=Path, required=True, help="the .npz to write")
    dump_parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help=case_help)

    compare_parser = commands.add_parser(
        "compare", help="compare two dumps made on this machine; exit code 0 iff bit-identical"
    )
    compare_parser.add_argument("a", type=Path)
    compare_parser.add_argument("b", type=Path)
    compare_parser.add_argument("--cases", nargs="+", choices=list(CASES), help="cases to compare (default: all)")

    run_parser = commands.add_parser("run", help="dump old (or reuse a baseline) and new, then compare")
    old = run_parser.add_mutually_exclusive_group(required=True)
    old.add_argument("--old", type=Path, help="source tree of the reference")
    old.add_argument("--baseline", type=Path, help="a dump of the reference made earlier on this machine")
    run_parser.add_argument("--new", type=Path, required=True, help="source tree to check")
    run_parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help=case_help)
    run_parser.add_argument("--work-dir", type=Path, help="where to keep the dumps (default: a new temporary folder)")

    worker_parser = commands.add_parser("worker", help="internal: train one case in this process")
    worker_parser.add_argument("case", choices=list(CASES))
    worker_parser.add_argument("--tree", type=Path, required=True)
    worker_parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "worker":
        worker(args.case, args.tree, args.out)
        return 0
    if args.command == "dump":
        dump(args.tree, args.out, args.cases)
        return 0
    if args.command == "compare":
        return 0 if compare(args.a, args.b, args.cases) else 1
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="compare_params_"))
    baseline = args.baseline
    if baseline is None:
        baseline = work_dir / "old.npz"
        dump(args.old, baseline, args.cases)
    new = work_dir / "new.npz"
    dump(args.new, new, args.cases)
    return 0 if compare(baseline, new, args.cases) else 1


if __name__ == "__main__":
    sys.exit(main())
