"""The `keras-dist` command line (also `python -m keras_dist`): a thin argparse layer.

    keras-dist launch --workers N [--min-workers M] [--max-restarts R] [--timeout S]
                      [--stall-timeout S] [--log-dir DIR [--tee]] [--verbose]
                      script.py [script args]
    keras-dist launch --workers N -m package.module [module args]
    keras-dist info
    keras-dist doctor [--no-self-test]
    keras-dist demo [--workers N] [--epochs E]
    keras-dist bench allreduce [--workers N] [--sizes 4K 1M ...] [--link-rate 10gbit]
    keras-dist plan --params P --step-ms T [--link-rate R ...] [--workers N ...]

Each subcommand parses its arguments and calls the library function that does the work
(`keras_dist.launching.local.launch`, ...), importing it only when needed so `--help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from typing import Sequence

__all__ = ["main"]

_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `keras-dist` command line.

    Args:
        argv: The arguments after the program name; `sys.argv[1:]` when `None`.

    Returns:
        The exit code: for `launch`, the `LaunchResult.returncode` (0 when all workers
        succeeded, the failing worker's code, 124 on timeout, 75 on a stall, 130 on
        Ctrl+C); 2 for usage errors.

    Example:
        >>> main(["launch", "--workers", "2", "train.py", "--epochs", "3"])
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # `info`, `demo` and `bench` import TensorFlow in this process; keep its C++ start-up
    # chatter out of their output, as `launch` does for workers.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = _build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "demo":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return args.handler(args, argv)
    except SystemExit as exit_request:  # argparse errors and --help; sys.exit in a command
        return _exit_code(exit_request.code)


def _build_parser() -> argparse.ArgumentParser:
    from keras_dist import __version__

    parser = argparse.ArgumentParser(
        prog="keras-dist",
        description="Distributed training with TensorFlow and Keras 3.",
    )
    parser.add_argument("--version", action="version", version=f"keras-dist {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_launch_parser(commands)

    info = commands.add_parser(
        "info", help="print the cluster, the devices and the strategy that would be chosen"
    )
    info.set_defaults(handler=_info_command, parser=info)

    doctor = commands.add_parser(
        "doctor", help="check this installation: versions, devices, cluster, compat fixes, "
        "and a 2-worker loopback self-test with its all-reduce bandwidth"
    )
    doctor.add_argument("--no-self-test", action="store_true",
                        help="skip the 2-worker self-test (versions and cluster only)")
    doctor.set_defaults(handler=_doctor_command, parser=doctor)

    demo = commands.add_parser("demo", help="train the embedded example on local workers")
    demo.add_argument("--workers", type=_int_at_least(1), metavar="N")
    demo.add_argument("--epochs", type=_int_at_least(1), metavar="E")
    demo.set_defaults(handler=_demo_command, parser=demo)

    bench = commands.add_parser("bench", help="run a benchmark")
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    allreduce = benchmarks.add_parser(
        "allreduce", help="all-reduce throughput: keras_dist against plain tf.distribute"
    )
    allreduce.add_argument("--workers", type=_int_at_least(1), default=2, metavar="N")
    allreduce.add_argument("--sizes", type=_size, nargs="+", default=None, metavar="SIZE",
                           help="tensor sizes in bytes; suffixes K, M, G allowed")
    allreduce.add_argument("--output", default=None, metavar="PATH",
                           help="write the results as JSON to PATH")
    from keras_dist.planning import _cli as plan_cli

    allreduce.add_argument("--link-rate", type=plan_cli._rate, default=None, metavar="RATE",
                           help="simulate each worker's link (10gbit, 1gbit, ...): the "
                           "workers run in a private network namespace whose loopback is "
                           "rate-limited with tc (needs root or CAP_NET_ADMIN)")
    allreduce.add_argument("--link-latency", type=plan_cli._duration, default=None,
                           metavar="TIME",
                           help="with the simulator, add this one-way latency (50us; netem)")
    allreduce.set_defaults(handler=_bench_allreduce_command, parser=allreduce)

    plan = commands.add_parser(
        "plan", help="predict step time and scaling efficiency on N workers at a link rate")
    plan_cli.add_arguments(plan)
    plan.set_defaults(handler=lambda args, argv: plan_cli.plan_main(args), parser=plan)
    return parser


def _add_launch_parser(commands) -> None:
    launch = commands.add_parser(
        "launch",
        help="run a training script on N local workers",
        description="Start N local workers of a script, each with its own TF_CONFIG on "
        "free 127.0.0.1 ports, prefix their output with [worker i], and stop all of them "
        "as soon as one fails. Options for keras-dist go before the script; everything "
        "after the script is passed to it.",
    )
    launch.add_argument("-n", "--workers", type=_int_at_least(1), default=2,
                        metavar="N", help="number of workers (default: 2)")
    launch.add_argument("--max-restarts", type=_int_at_least(0), default=0, metavar="R",
                        help="restart the whole group up to R times after a failure")
    launch.add_argument("--min-workers", type=_int_at_least(1), default=None, metavar="M",
                        help="shrink instead of stopping: a worker slot that fails again "
                        "before its restarted group came up is dropped, down to M workers "
                        "(each shrink is one of the R restarts)")
    launch.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                        help="stop all workers after S seconds (exit code 124)")
    launch.add_argument("--stall-timeout", type=_non_negative_float, default=None,
                        metavar="S",
                        help="a stall is S seconds in which no worker made progress in a "
                        "Keras loop: name the workers behind, print their Python stacks, "
                        "stop the group and restart it (one of --max-restarts); exit code "
                        "75 when out of restarts. 0 turns it off. Default: "
                        "KERAS_DIST_STALL_TIMEOUT, else max(300, 20 x the slowest step); "
                        "start-up, tracing and backups get KERAS_DIST_STARTUP_TIMEOUT "
                        "(600)")
    launch.add_argument("--grace-period", type=_non_negative_float, default=10.0,
                        metavar="S", help="seconds between SIGTERM and SIGKILL (default 10)")
    launch.add_argument("--no-prefix", action="store_true",
                        help="do not prefix output lines with [worker i]")
    launch.add_argument("--log-dir", default=None, metavar="DIR",
                        help="write each worker's output to DIR/worker-<i>.log and the "
                        "launcher's to DIR/launcher.log (worker output then leaves the "
                        "terminal unless --tee)")
    launch.add_argument("--tee", action="store_true",
                        help="with --log-dir, also show worker output on the terminal")
    launch.add_argument("--verbose", action="store_true", default=None,
                        help="keep TensorFlow's start-up logs and Keras' shuffle warning "
                        "(also KERAS_DIST_TF_LOGS=1)")
    launch.add_argument("--preload", action="store_true",
                        help="fork the workers (and every restart) from a process that "
                        "already imported TensorFlow and Keras: seconds faster per worker; "
                        "settings TensorFlow reads at import must come from the "
                        "environment")
    launch.add_argument("-m", "--module", action="store_true",
                        help="treat SCRIPT as a module name and run `python -m SCRIPT`")
    launch.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                        help="arguments for the script")
    launch.set_defaults(handler=_launch_command, parser=launch)


# -- commands ----------------------------------------------------------------------------
class _Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP to the launcher: stop the workers like Ctrl+C does."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _launch_command(args: argparse.Namespace, argv: list[str]) -> int:
    from keras_dist.launching.local import launch

    if args.tee and args.log_dir is None:
        args.parser.error("--tee needs --log-dir DIR")
    if args.min_workers is not None and args.min_workers > args.workers:
        args.parser.error(f"--min-workers ({args.min_workers}) must be at most --workers "
                          f"({args.workers}): it is the smallest group to shrink to")
    from keras_dist.stall.policy import stall_timeout

    try:  # KERAS_DIST_STALL_TIMEOUT, checked before any worker starts
        stall_timeout(args.stall_timeout)
    except ValueError as error:
        args.parser.error(str(error))
    if args.module:
        command = [sys.executable, "-m", args.script, *args.script_args]
    else:
        if not os.path.isfile(args.script) and not os.path.isfile(
            os.path.join(args.script, "__main__.py")
        ):
            args.parser.error(f"script {args.script!r} not found (looked in {os.getcwd()})")
        command = [sys.executable, args.script, *args.script_args]
    previous = _install_termination_handlers()
    try:
        result = launch(
            command,
            args.workers,
            max_restarts=args.max_restarts,
            min_workers=args.min_workers,
            timeout=args.timeout,
            prefix=not args.no_prefix,
            grace_period=args.grace_period,
            log_dir=args.log_dir,
            tee=args.tee,
            verbose=args.verbose,
            preload=args.preload,
            stall_timeout=args.stall_timeout,
        )
    except _Terminated as termination:
        return 128 + termination.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except OSError as error:
        print(f"keras-dist launch: cannot start the workers: {error}", file=sys.stderr)
        return 1
    finally:
        _restore_handlers(previous)
    return result.returncode


def _info_command(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        info_lines = importlib.import_module("keras_dist.strategies.factory")._info_lines
    except (ImportError, AttributeError) as error:
        print(f"keras-dist info: not available in this installation ({error})",
              file=sys.stderr)
        return 1
    for line in info_lines():
        print(line)
    return 0


def _doctor_command(args: argparse.Namespace, argv: list[str]) -> int:
    from keras_dist.launching import doctor

    return doctor.main(run_self_test=not args.no_self_test)


def _demo_command(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        demo = importlib.import_module("keras_dist.examples.demo")
    except ModuleNotFoundError as error:
        if error.name not in ("keras_dist.examples", "keras_dist.examples.demo"):
            raise
        print("keras-dist demo: the example is not available in this installation "
              f"({error})", file=sys.stderr)
        return 1
    # The demo parses its own options; pass everything after "demo" through unchanged.
    demo_argv = argv[argv.index("demo") + 1:]
    return _exit_code(demo.main(demo_argv))


def _bench_allreduce_command(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        bench = importlib.import_module("keras_dist.planning.bench")
        allreduce_main = bench.allreduce_main
    except (ModuleNotFoundError, AttributeError) as error:
        if isinstance(error, ModuleNotFoundError) and error.name != "keras_dist.planning.bench":
            raise
        print("keras-dist bench allreduce: the all-reduce benchmark is not available in "
              f"this installation ({error}). Run benchmarks/ from a source checkout.",
              file=sys.stderr)
        return 1
    from keras_dist.planning import LinkSimulatorError

    try:
        return _exit_code(allreduce_main(args))
    except LinkSimulatorError as error:
        print(f"keras-dist bench allreduce: {error}", file=sys.stderr)
        return 1


# -- helpers -----------------------------------------------------------------------------
def _install_termination_handlers() -> dict:
    # A scheduler or `kill` sends SIGTERM; without a handler the launcher would die at
    # once and its workers (in their own sessions) would keep running as orphans.
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}

    def terminate(signum, frame):
        raise _Terminated(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, terminate)
    return previous


def _restore_handlers(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, received {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}, received {value}"
            )
        return value

    return parse


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, received {text!r}")


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, received {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, received {text}")
    return value


def _size(text: str) -> int:
    number, suffix = text.strip(), ""
    if number[-1:].upper() in ("K", "M", "G"):
        number, suffix = number[:-1], number[-1].upper()
    try:
        value = int(number) * _SIZE_SUFFIXES[suffix]
    except ValueError:
        value = -1
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 4096, 64K or 16M, received {text!r}"
        )
    return value
