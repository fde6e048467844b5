"""
Command line: ``sb3-speedups {train,enjoy,...}``. Argument parsing only: each command turns its arguments into a
small config object and calls one function of :mod:`sb3_speedups.zoo` (or ``tune``/``bench``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sb3_speedups.errors import UserError
from sb3_speedups.registry import ALGOS
from sb3_speedups.tune.cli_args import add_tune_arguments, run_tune

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algo", required=True, help=f"algorithm: {', '.join(ALGOS)}")
    parser.add_argument("--env", required=True, help="gymnasium environment id")
    parser.add_argument("--device", default="auto", help="torch device (auto, cpu, cuda)")
    parser.add_argument("--stock", action="store_true", help="use the stock SB3 / sb3-contrib class instead of ours")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``train``, named as in the RL Zoo."""
    from sb3_speedups.zoo.envs import VEC_ENV_CLASSES

    _add_common(parser)
    parser.add_argument("-n", "--n-timesteps", type=int, default=-1, help="budget; default: the YAML's n_timesteps")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: drawn and recorded)")
    parser.add_argument("-conf", "--conf-file", default=None, help="RL-Zoo-format YAML file (default: bundled)")
    parser.add_argument(
        "-params",
        "--hyperparams",
        nargs="+",
        default=[],
        metavar="KEY:VALUE",
        help="override hyperparameters, e.g. learning_rate:0.001 n_envs:4",
    )
    parser.add_argument("-f", "--log-folder", default="logs", help="root folder of the runs")
    parser.add_argument("--eval-freq", type=int, default=25_000, help="evaluate every N env steps (<= 0: never)")
    parser.add_argument("--eval-episodes", type=int, default=5, help="episodes per evaluation")
    parser.add_argument("--n-eval-envs", type=int, default=1, help="envs of the evaluation env")
    parser.add_argument("--save-freq", type=int, default=-1, help="checkpoint every N env steps (<= 0: never)")
    parser.add_argument("--vec-env", default="dummy", choices=list(VEC_ENV_CLASSES), help="VecEnv type")
    parser.add_argument("-tb", "--tensorboard-log", default="", help="tensorboard log folder")
    parser.add_argument("-i", "--trained-agent", default="", help="model .zip to continue training")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show the progress bar")
    parser.add_argument("--num-threads", type=int, default=-1, help="torch threads (default: 1 on CPU unless set)")
    parser.add_argument("--verbose", type=int, default=1, help="verbosity (0, 1, 2)")


def run_train(args: argparse.Namespace) -> int:
    """``train``: one training run."""
    from sb3_speedups.zoo.hyperparams import parse_overrides
    from sb3_speedups.zoo.train import TrainConfig, train

    config = TrainConfig(
        algo=args.algo, env_id=args.env, n_timesteps=args.n_timesteps, seed=args.seed, conf_file=args.conf_file,
        hyperparams=parse_overrides(args.hyperparams), log_folder=args.log_folder, eval_freq=args.eval_freq,
        eval_episodes=args.eval_episodes, n_eval_envs=args.n_eval_envs, save_freq=args.save_freq, vec_env=args.vec_env,
        device=args.device, tensorboard_log=args.tensorboard_log, trained_agent=args.trained_agent, progress=args.progress,
        num_threads=args.num_threads, verbose=args.verbose, stock=args.stock,
    )  # fmt: skip
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        result = train(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 130 if result.interrupted else 0


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def add_enjoy_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``enjoy``."""
    _add_common(parser)
    parser.add_argument("-f", "--folder", default="logs", help="log folder, run folder or model .zip")
    parser.add_argument("--exp-id", type=int, default=0, help="run id in the log folder (0: latest)")
    parser.add_argument("--n-episodes", type=int, default=10, help="evaluation episodes")
    parser.add_argument("--load-best", action="store_true", help="load best_model.zip")
    parser.add_argument("--stochastic", action="store_true", help="sample actions instead of deterministic ones")
    parser.add_argument("--seed", type=int, default=0, help="seed of the evaluation env")


def run_enjoy(args: argparse.Namespace) -> int:
    """``enjoy``: evaluate a saved run."""
    from sb3_speedups.zoo.enjoy import EnjoyConfig, enjoy

    enjoy(EnjoyConfig(
        algo=args.algo, env_id=args.env, folder=args.folder, exp_id=args.exp_id, n_episodes=args.n_episodes,
        load_best=args.load_best, deterministic=not args.stochastic, seed=args.seed, device=args.device, stock=args.stock,
    ))  # fmt: skip
    return 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench``."""
    from sb3_speedups.bench.worker import VARIANTS
    from sb3_speedups.zoo.envs import VEC_ENV_CLASSES

    parser.add_argument("--algo", required=True, help=f"algorithm: {', '.join(ALGOS)}")
    parser.add_argument("--env", required=True, help="gymnasium environment id")
    parser.add_argument("-n", "--n-timesteps", type=int, default=-1, help="budget per run (default: the YAML's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (every variant runs each)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["ours", "stock"],
        help=f"{', '.join(VARIANTS)}; ours: our class; stock: stock class, torch defaults; stock-1t: stock, 1 thread + "
        "fused Adam; add @<vec env> to give one variant its own VecEnv (ours@batched ours@dummy)",
    )
    parser.add_argument("-conf", "--conf-file", default=None, help="hyperparameters file of every variant")
    parser.add_argument("--ours-conf-file", default=None, help="a different hyperparameters file for ours only")
    parser.add_argument("-params", "--hyperparams", nargs="+", default=[], metavar="KEY:VALUE", help="overrides")
    parser.add_argument("--vec-env", default="dummy", choices=list(VEC_ENV_CLASSES), help="VecEnv of the training env")
    parser.add_argument("--eval-episodes", type=int, default=10, help="episodes of the final evaluation")
    parser.add_argument("--curve-points", type=int, default=5, help="evaluations during training (clock paused)")
    parser.add_argument("--target-return", type=float, default=None, help="time-to-target mode: stop at this return")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--out-dir", default="bench_results", help="folder of the JSON and PNG results")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run before it is killed")


def run_bench(args: argparse.Namespace) -> int:
    """``bench``: ours vs stock, alternating, each run in a fresh process."""
    from sb3_speedups.bench.core import BenchConfig, run_benchmark
    from sb3_speedups.bench.report import format_table
    from sb3_speedups.zoo.hyperparams import parse_overrides
    from sb3_speedups.zoo.train import prepare_experiment, TrainConfig

    prepare_experiment(TrainConfig(algo=args.algo, env_id=args.env, conf_file=args.conf_file))  # fail fast on bad input
    config = BenchConfig(
        algo=args.algo, env_id=args.env, n_timesteps=args.n_timesteps, seeds=args.seeds, variants=args.variants,
        conf_file=args.conf_file, ours_conf_file=args.ours_conf_file, hyperparams=parse_overrides(args.hyperparams),
        vec_env=args.vec_env, eval_episodes=args.eval_episodes, curve_points=args.curve_points,
        target_return=args.target_return, out_dir=args.out_dir, device=args.device,
    )  # fmt: skip
    print(f"Benchmark {args.algo} on {args.env}: variants {args.variants}, seeds {args.seeds}")
    result = run_benchmark(config, timeout=args.timeout)
    print(format_table(result["summary"], target=args.target_return is not None))
    print(f"Results: {result['json']}" + (f", plot: {result['png']}" if result["png"] else ""))
    return 0


def add_bench_vec_env_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench-vec-env``."""
    from sb3_speedups.zoo.envs import VEC_ENV_CLASSES

    parser.add_argument("--env", default="CartPole-v1", help="gymnasium id")
    parser.add_argument("--kinds", nargs="+", default=["batched"],
                        help=f"from: {', '.join(VEC_ENV_CLASSES)}; options as batched:n_local=4,spin_us=0 "
                        "(dummy and subproc always run)")  # fmt: skip
    parser.add_argument("--n-envs", type=int, default=8, help="number of envs")
    parser.add_argument("--block-steps", type=int, default=100, help="VecEnv steps per timed block")
    parser.add_argument("--rounds", type=int, default=20, help="timed blocks per kind")
    parser.add_argument("--start-method", default=None, help="start method for the throughput runs")
    parser.add_argument("--startup-methods", nargs="*", default=[], help="start methods to time start-up for")
    parser.add_argument("--startup-repeats", type=int, default=3, help="start-up measurements per kind and method")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def run_bench_vec_env(args: argparse.Namespace) -> int:
    """``bench-vec-env``: env-steps/s with random actions per VecEnv kind, and start-up time."""
    from sb3_speedups.bench.vec_env import run_vec_env_benchmark

    print(run_vec_env_benchmark(
        args.env, args.kinds, args.n_envs, args.block_steps, args.rounds, args.start_method, args.startup_methods,
        args.startup_repeats, args.out,
    ))  # fmt: skip
    return 0


COMMANDS: dict[str, Command] = {
    "train": (add_train_arguments, run_train, "train an agent with RL-Zoo-format hyperparameters"),
    "enjoy": (add_enjoy_arguments, run_enjoy, "evaluate a trained agent"),
    "bench": (add_bench_arguments, run_bench, "benchmark ours against stock SB3 on the same config and seeds"),
    "bench-vec-env": (add_bench_vec_env_arguments, run_bench_vec_env, "benchmark VecEnv kinds (env-steps/s, start-up)"),
    "tune": (add_tune_arguments, run_tune, "search hyperparameters with Optuna (pruning, worker processes, shared studies)"),
}


def build_parser() -> argparse.ArgumentParser:
    """:return: the parser with one sub-command per entry of :data:`COMMANDS`"""
    parser = argparse.ArgumentParser(prog="sb3-speedups", description="Faster drop-in Stable-Baselines3 algorithms.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
        sub.choices[name].set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """
    :param argv: arguments without the program name (default: ``sys.argv[1:]``)
    :return: exit code (0 ok, 2 bad input, 130 interrupted)
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line error
        return int(exc.code or 0)
    try:
        return int(args.run(args))
    except UserError as exc:
        print(f"sb3-speedups {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("Interrupted", file=sys.stderr)
        return 130


def main_entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
