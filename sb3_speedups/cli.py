"""
Command line: ``sb3-speedups {train,enjoy,...}``. Argument parsing only: each command turns its arguments into a
small config object and calls one function of :mod:`sb3_speedups.zoo` (or ``tune``/``bench``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from sb3_speedups import __version__
from sb3_speedups.errors import UserError
from sb3_speedups.registry import ALGOS
from sb3_speedups.tune import PRUNERS, SAMPLERS

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]
MAX_SEED = 2**32 - 1  # numpy's limit


class ArgumentParser(argparse.ArgumentParser):
    """argparse with every default in ``--help``, and bad input reported in one line (no usage block), exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """
    :param low: smallest accepted value
    :param high: largest accepted value, ``None`` for no limit
    :return: an argparse ``type`` that accepts integers in ``[low, high]``
    """
    expected = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """argparse ``type``: a finite number > 0"""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def finite_float(text: str) -> float:
    """argparse ``type``: a finite number"""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not abs(value) < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


POSITIVE, NON_NEGATIVE, SEED = int_range(1), int_range(0), int_range(0, MAX_SEED)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algo", required=True, help=f"algorithm: {', '.join(ALGOS)}")
    parser.add_argument("--env", required=True, help="gymnasium environment id")
    parser.add_argument("--device", default="auto", help="torch device (auto, cpu, cuda)")
    parser.add_argument("--stock", action="store_true", help="use the stock SB3 / sb3-contrib class instead of ours")


def _add_hyperparams(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("-conf", "--conf-file", default=None, help="RL-Zoo-format YAML file; None: the bundled one")
    parser.add_argument("-params", "--hyperparams", nargs="+", default=[], metavar="KEY:VALUE", help=help_text)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``train``, named as in the RL Zoo."""
    from sb3_speedups.zoo.envs import VEC_ENV_CLASSES

    _add_common(parser)
    parser.add_argument("-n", "--n-timesteps", type=POSITIVE, default=None, help="budget; None: the YAML's n_timesteps")
    parser.add_argument("--seed", type=SEED, default=None, help="random seed; None: drawn and recorded in args.yml")
    _add_hyperparams(parser, "override hyperparameters, e.g. learning_rate:0.001 n_envs:4")
    parser.add_argument("-f", "--log-folder", default="logs", help="root folder of the runs")
    parser.add_argument("--eval-freq", type=NON_NEGATIVE, default=25_000, help="evaluate every N env steps (0: never)")
    parser.add_argument("--eval-episodes", type=POSITIVE, default=5, help="episodes per evaluation")
    parser.add_argument("--n-eval-envs", type=POSITIVE, default=1, help="envs of the evaluation env")
    parser.add_argument("--save-freq", type=NON_NEGATIVE, default=0, help="checkpoint every N env steps (0: never)")
    parser.add_argument("--vec-env", default="dummy", choices=list(VEC_ENV_CLASSES), help="VecEnv type")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster of --vec-env ray: auto (started here with `ray start`) or HOST:PORT; "
                        "default: RAY_ADDRESS, else a new local Ray")  # fmt: skip
    parser.add_argument("-tb", "--tensorboard-log", default="", help="tensorboard log folder")
    parser.add_argument("-i", "--trained-agent", default="", help="model .zip to continue training")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show the progress bar")
    parser.add_argument("--num-threads", type=POSITIVE, default=None, help="torch threads; None: 1 on CPU unless set")
    parser.add_argument(
        "--verbose",
        type=int_range(0, 2),
        default=1,
        help="0: where it saved and the final return; 1: also one line per evaluation; 2: also SB3's logger tables",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors (no progress bar either)")


def run_train(args: argparse.Namespace) -> int:
    """``train``: one training run."""
    from sb3_speedups.zoo.envs import vec_env_class
    from sb3_speedups.zoo.hyperparams import parse_overrides
    from sb3_speedups.zoo.train import TrainConfig, train

    if args.ray_address is not None and args.vec_env != "ray":
        raise UserError("--ray-address is an option of --vec-env ray; add --vec-env ray or drop --ray-address")
    vec_env_class(args.vec_env)  # a missing optional dependency (ray) fails here, before the run folder is made
    config = TrainConfig(
        algo=args.algo, env_id=args.env, n_timesteps=_or_minus_one(args.n_timesteps), seed=args.seed,
        conf_file=args.conf_file, hyperparams=parse_overrides(args.hyperparams), log_folder=args.log_folder,
        eval_freq=args.eval_freq, eval_episodes=args.eval_episodes, n_eval_envs=args.n_eval_envs,
        save_freq=args.save_freq, vec_env=args.vec_env, ray_address=args.ray_address, device=args.device,
        tensorboard_log=args.tensorboard_log,
        trained_agent=args.trained_agent, progress=args.progress and not args.quiet,
        num_threads=_or_minus_one(args.num_threads), verbose=args.verbose, quiet=args.quiet, stock=args.stock,
    )  # fmt: skip
    with _sigterm_interrupts():
        result = train(config)
    return 130 if result.interrupted else 0


def _or_minus_one(value: int | None) -> int:
    """The config objects take ``-1`` for "not given" (the YAML's budget, the package's thread count)."""
    return -1 if value is None else value


class _sigterm_interrupts:
    """SIGTERM ends a command as Ctrl-C does (a ``KeyboardInterrupt``: models are saved, studies kept)."""

    def __enter__(self) -> None:
        self.previous = signal.signal(signal.SIGTERM, self._raise)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self.previous)

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt


def add_enjoy_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``enjoy``."""
    _add_common(parser)
    parser.add_argument("-f", "--folder", default="logs", help="log folder, run folder or model .zip")
    parser.add_argument("--exp-id", type=NON_NEGATIVE, default=0, help="run id in the log folder (0: latest)")
    parser.add_argument("--n-episodes", type=POSITIVE, default=10, help="evaluation episodes")
    parser.add_argument("--load-best", action="store_true", help="load best_model.zip")
    parser.add_argument("--stochastic", action="store_true", help="sample actions instead of deterministic ones")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the evaluation env")


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
    parser.add_argument("-n", "--n-timesteps", type=POSITIVE, default=None, help="budget per run; None: the YAML's")
    parser.add_argument("--seeds", type=SEED, nargs="+", default=[0, 1, 2], help="seeds (every variant runs each)")
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
    parser.add_argument("--eval-episodes", type=POSITIVE, default=10, help="episodes of the final evaluation")
    parser.add_argument("--curve-points", type=NON_NEGATIVE, default=5, help="evaluations during training (clock paused)")
    parser.add_argument("--target-return", type=finite_float, default=None, help="time-to-target mode: stop at this return")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--out-dir", default="bench_results", help="folder of the JSON and PNG results")
    parser.add_argument("--timeout", type=positive_float, default=None, help="seconds per run before it is killed")


def run_bench(args: argparse.Namespace) -> int:
    """``bench``: ours vs stock, alternating, each run in a fresh process."""
    from sb3_speedups.bench.core import BenchConfig, run_benchmark
    from sb3_speedups.bench.report import format_table
    from sb3_speedups.zoo.hyperparams import parse_overrides
    from sb3_speedups.zoo.train import prepare_experiment, TrainConfig

    prepare_experiment(TrainConfig(algo=args.algo, env_id=args.env, conf_file=args.conf_file))  # fail fast on bad input
    config = BenchConfig(
        algo=args.algo, env_id=args.env, n_timesteps=_or_minus_one(args.n_timesteps), seeds=args.seeds, variants=args.variants,
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
    parser.add_argument("--n-envs", type=POSITIVE, default=8, help="number of envs")
    parser.add_argument("--block-steps", type=POSITIVE, default=100, help="VecEnv steps per timed block")
    parser.add_argument("--rounds", type=POSITIVE, default=20, help="timed blocks per kind")
    parser.add_argument("--start-method", default=None, help="start method for the throughput runs")
    parser.add_argument("--startup-methods", nargs="*", default=[], help="start methods to time start-up for")
    parser.add_argument("--startup-repeats", type=POSITIVE, default=3, help="start-up measurements per kind and method")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--step-cost-ms", type=float, default=0.0,
                        help="CPU work added to every env step, in ms (an expensive simulator)")  # fmt: skip


def run_bench_vec_env(args: argparse.Namespace) -> int:
    """``bench-vec-env``: env-steps/s with random actions per VecEnv kind, and start-up time."""
    from sb3_speedups.bench.vec_env import run_vec_env_benchmark

    print(run_vec_env_benchmark(
        args.env, args.kinds, args.n_envs, args.block_steps, args.rounds, args.start_method, args.startup_methods,
        args.startup_repeats, args.out, args.step_cost_ms,
    ))  # fmt: skip
    return 0


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tune`` (named as the RL Zoo's ``--optimize`` flags where it has them)."""
    from sb3_speedups.zoo.envs import VEC_ENV_CLASSES

    _add_common(parser)
    parser.add_argument(
        "--n-trials", type=POSITIVE, default=500, help="trials of the study to finish (resuming counts done ones)"
    )
    parser.add_argument("--n-jobs", type=POSITIVE, default=1, help="parallel worker processes on this machine")
    parser.add_argument("--sampler", default="tpe", choices=SAMPLERS, help="Optuna sampler")
    parser.add_argument("--pruner", default="median", choices=PRUNERS, help="Optuna pruner")
    parser.add_argument(
        "--n-startup-trials", type=NON_NEGATIVE, default=10, help="random trials before the sampler and pruner act"
    )
    parser.add_argument("--n-evaluations", type=POSITIVE, default=4, help="evaluations per trial (pruning points)")
    parser.add_argument("-n", "--n-timesteps", type=POSITIVE, default=None, help="budget per trial; None: the YAML's")
    parser.add_argument(
        "--eval-freq", type=POSITIVE, default=None, help="evaluate every N env steps; None: --n-evaluations times"
    )
    parser.add_argument("--n-eval-episodes", "--eval-episodes", type=POSITIVE, default=5, help="episodes per evaluation")
    parser.add_argument("--n-eval-envs", type=POSITIVE, default=1, help="envs of the evaluation env")
    parser.add_argument(
        "--storage",
        default=None,
        help="None: SQLite file in the study folder; a .log file (journal, shared by processes of one machine) "
        "or a database URL such as postgresql://user:password@host/db (shared by several machines)",
    )
    parser.add_argument("--study-name", default=None, help="None: <algo>_<env>; the same name resumes or joins a study")
    parser.add_argument("--timeout", type=positive_float, default=None, help="start no new trial after this many seconds")
    parser.add_argument("--seed", type=SEED, default=None, help="seed of the sampler and of every trial; None: drawn")
    parser.add_argument("-f", "--log-folder", default="logs", help="outputs go to <log-folder>/tune/<study-name>/")
    parser.add_argument("--search-space", default=None, help="YAML file extending (or replacing) the built-in search space")
    _add_hyperparams(parser, "fixed hyperparameters, e.g. n_envs:4")
    parser.add_argument("--trial-seeds", type=POSITIVE, default=1, help="seeds per trial; the objective is their mean return")
    parser.add_argument("--vec-env", default="dummy", choices=list(VEC_ENV_CLASSES), help="VecEnv type")
    parser.add_argument("--num-threads", type=POSITIVE, default=None, help="torch threads per process; None: 1 on CPU")
    parser.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="write the PNG plots")
    parser.add_argument(
        "--verbose",
        type=int_range(0, 3),
        default=1,
        help="0 quiet, 1 a line per trial, 2 also Optuna's log, 3 also the trainings' logger tables",
    )


def run_tune(args: argparse.Namespace) -> int:
    """
    ``tune``: run or resume a study; exit code 130 when interrupted, 1 when a worker process died or no trial
    completed.
    """
    from sb3_speedups.tune.tuner import TuneConfig, tune
    from sb3_speedups.zoo.hyperparams import parse_overrides

    config = TuneConfig(
        algo=args.algo, env_id=args.env, n_trials=args.n_trials, n_jobs=args.n_jobs, sampler=args.sampler,
        pruner=args.pruner, n_startup_trials=args.n_startup_trials, n_evaluations=args.n_evaluations,
        n_timesteps=_or_minus_one(args.n_timesteps), eval_freq=_or_minus_one(args.eval_freq),
        n_eval_episodes=args.n_eval_episodes, n_eval_envs=args.n_eval_envs, storage=args.storage,
        study_name=args.study_name, timeout=args.timeout, seed=args.seed, log_folder=args.log_folder,
        search_space=args.search_space, conf_file=args.conf_file, hyperparams=parse_overrides(args.hyperparams),
        trial_seeds=args.trial_seeds, vec_env=args.vec_env, device=args.device, stock=args.stock,
        num_threads=_or_minus_one(args.num_threads), verbose=args.verbose, plots=args.plots,
    )  # fmt: skip
    with _sigterm_interrupts():
        result = tune(config)
    if result.interrupted:
        return 130
    if result.failed_workers:
        print(
            f"sb3-speedups tune: error: {'; '.join(result.failed_workers)}; the study is kept: run the same command "
            "to continue it",
            file=sys.stderr,
        )
        return 1
    return 0 if result.best_value is not None else 1


COMMANDS: dict[str, Command] = {
    "train": (add_train_arguments, run_train, "train an agent with RL-Zoo-format hyperparameters"),
    "enjoy": (add_enjoy_arguments, run_enjoy, "evaluate a trained agent"),
    "bench": (add_bench_arguments, run_bench, "benchmark ours against stock SB3 on the same config and seeds"),
    "bench-vec-env": (add_bench_vec_env_arguments, run_bench_vec_env, "benchmark VecEnv kinds (env-steps/s, start-up)"),
    "tune": (add_tune_arguments, run_tune, "search hyperparameters with Optuna (pruning, worker processes, shared studies)"),
}


def build_parser() -> argparse.ArgumentParser:
    """:return: the parser with one sub-command per entry of :data:`COMMANDS`"""
    parser = ArgumentParser(prog="sb3-speedups", description="Faster drop-in Stable-Baselines3 algorithms.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
    except SystemExit as exc:  # --help, --version, or the one-line error of ArgumentParser.error
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
