"""What a launch is asked to do besides the command and the worker count: `Options`.

Shared by every launcher (`keras-dist launch`, `notebook_launcher`, `keras_dist.testing`,
the worker pool), which all run through `keras_dist.launching.local.run_group`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import IO, Mapping, Sequence

from keras_dist import _validation
from keras_dist.launching import output as _output
from keras_dist.stall.policy import StallTimeout, check_stall_timeout, stall_timeout

__all__ = ["Options", "checked_command", "checked_options", "worker_env"]


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything about a launch but the command and the worker count (validated)."""

    max_restarts: int = 0
    env: Mapping[str, str | None] | None = None
    timeout: float | None = None
    stdout: IO[str] | None = None
    prefix: bool = True
    grace_period: float = 10.0
    log_dir: str | None = None
    tee: bool = False
    verbose: bool | None = None
    set_tf_config: bool = True  # False runs lone processes (run_in_subprocess)
    min_workers: int | None = None  # None: never shrink
    # Fork workers from a process that already imported TensorFlow (launching/zygote.py).
    preload: bool = False
    # Seconds without progress that make a stall (`keras_dist.stall.policy`); None reads
    # KERAS_DIST_STALL_TIMEOUT (the workers' environment), else the default; 0: off.
    stall_timeout: float | None = None

    def resolved_stall_timeout(self, environ: Mapping[str, str]) -> StallTimeout:
        return stall_timeout(self.stall_timeout, environ=environ)


def checked_options(max_restarts, env, timeout, stdout, prefix, grace_period, log_dir, tee,
                    verbose, min_workers, preload, stall_timeout=None) -> Options:
    """`launch()`'s keyword arguments, checked (the rest are checked by `run_group`)."""
    _validation.check_int("max_restarts", max_restarts, minimum=0)
    _validation.check_number("grace_period", grace_period, minimum=0, exclusive=False,
                             unit="seconds")
    _validation.check_bool("prefix", prefix)
    _validation.check_bool("tee", tee)
    _validation.check_bool("preload", preload)
    if verbose is not None:
        _validation.check_bool("verbose", verbose)
    if log_dir is not None:
        log_dir = os.fspath(log_dir)
    elif tee:
        raise ValueError(_validation.message("tee", "False without `log_dir`", tee,
                                             "Pass log_dir=... to write log files"))
    check_stall_timeout(stall_timeout)
    return Options(max_restarts, env, timeout, stdout, prefix, grace_period, log_dir, tee,
                   verbose, min_workers=min_workers, preload=preload,
                   stall_timeout=stall_timeout)


def worker_env(options: Options) -> dict[str, str]:
    """The environment every worker starts from: ours, `options.env`, the launcher's keys."""
    env = options.env
    merged = dict(os.environ)
    items = env.items() if isinstance(env, Mapping) else [(None, env)] if env else []
    for key, value in items:
        if not isinstance(key, str) or not (value is None or isinstance(value, str)):
            raise ValueError("Argument `env` must map strings to strings (or None to "
                             f"unset). Received: env={env!r}")
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    explicit = {key: value for key, value in items if value is not None}
    _output.quiet_env(merged, _output.is_quiet(options.verbose, merged), explicit)
    merged["KERAS_DIST_LAUNCHED"] = "1"
    merged["PYTHONUNBUFFERED"] = "1"  # so output arrives while the worker runs
    if not options.set_tf_config:
        merged.pop("TF_CONFIG", None)
    return merged


def checked_command(command) -> list[str]:
    """`command` as a list of strings, or a ValueError saying what an argv is."""
    if (isinstance(command, (str, bytes)) or not isinstance(command, Sequence) or not command
            or not all(isinstance(part, (str, os.PathLike)) for part in command)):
        raise ValueError(
            "Argument `command` must be a non-empty list of strings (an argv such as "
            f"[sys.executable, 'train.py']). Received: command={command!r}"
        )
    return [os.fspath(part) for part in command]
