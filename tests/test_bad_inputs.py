"""The checked list of bad inputs across keras_dist's public API.

Each row of `CASES` is a call a user might get wrong, the exception it must raise and a
fragment of the message (which must say what was received and what is expected). The
same table, rendered, is docs/bad_inputs.md; `test_docs_table_is_current` keeps the two
equal. After adding a row, regenerate the page with

    python tests/test_bad_inputs.py > docs/bad_inputs.md

Everything runs in this process: the checks happen before TensorFlow builds anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_PAGE = os.path.join(REPO_ROOT, "docs", "bad_inputs.md")
TWO_WORKERS = json.dumps({"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:1112"]},
                          "task": {"type": "worker", "index": 0}})


class CommandLineError(Exception):
    """`keras-dist ...` exited non-zero; the message is `exit <code>: <stderr>`."""


def keras_dist_cli(*argv: str) -> None:
    """Runs the `keras-dist` command line in this process, like the console script."""
    from keras_dist.launching import cli

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = cli.main(list(argv))
    if code:
        raise CommandLineError(f"exit {code}: {stderr.getvalue().strip()}")


@dataclasses.dataclass(frozen=True)
class Case:
    api: str
    call: str  # evaluated with the names of `_namespace()`; shown verbatim in the docs
    error: type
    fragment: str
    env: dict | None = None  # environment for the call (e.g. a TF_CONFIG)


def _c(api, call, error, fragment, env=None):
    return Case(api, call, error, fragment, env)


def _cases() -> list[Case]:
    from keras_dist import ClusterConfigError
    from keras_dist.checkpointing import BackupError

    cases = [
        # -- strategy() ----------------------------------------------------------------
        _c("strategy", "keras_dist.strategy('tpu')", ValueError, "Argument `kind` must be one of"),
        _c("strategy", "keras_dist.strategy(cross_device_ops='nccl')", ValueError,
           "Argument `cross_device_ops` must be a tf.distribute.CrossDeviceOps instance"),
        _c("strategy", "keras_dist.strategy(startup_timeout_seconds=0)", ValueError,
           "Argument `startup_timeout_seconds` must be a number > 0 (seconds) or None"),
        _c("barrier", "keras_dist.barrier(name=3)", ValueError, "Argument `name` must be None"),
        _c("barrier", "keras_dist.barrier(timeout_seconds=-1)", ValueError,
           "Argument `timeout_seconds` must be a positive number of seconds or None"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], tee=True)", ValueError,
           "Argument `tee` must be False without `log_dir`"),
        _c("strategy", "keras_dist.strategy(implementation='mpi')", ValueError,
           "Argument `implementation` must be one of"),
        _c("strategy", "keras_dist.strategy(bytes_per_pack=-1)", ValueError,
           "`bytes_per_pack` must be an integer >= 0"),
        _c("strategy", "keras_dist.strategy(timeout_seconds=0)", ValueError,
           "`timeout_seconds` must be a positive number"),
        _c("strategy", "keras_dist.strategy(timeout_seconds='60')", ValueError,
           "`timeout_seconds` must be a positive number"),
        _c("strategy", "keras_dist.strategy(devices='/cpu:0')", ValueError,
           "`devices` must be a non-empty list"),
        _c("strategy", "keras_dist.strategy(devices=['/cpu:0', '/cpu:0'])", ValueError,
           "`devices` repeats a device"),
        _c("strategy", "keras_dist.strategy('multi_worker')", ValueError,
           "no multi-worker cluster is configured", env={"TF_CONFIG": None}),
        _c("strategy", "keras_dist.strategy('mirrored')", ValueError,
           "kind='multi_worker' or 'auto'", env={"TF_CONFIG": TWO_WORKERS}),
        _c("strategy", "keras_dist.strategy(devices=['/cpu:0'])", ValueError,
           "CUDA_VISIBLE_DEVICES", env={"TF_CONFIG": TWO_WORKERS}),
        _c("strategy", "keras_dist.strategy()", ClusterConfigError,
           "TF_CONFIG is not valid JSON", env={"TF_CONFIG": "{not json"}),
        _c("resolve_strategy", "keras_dist.resolve_strategy('mirrored')", TypeError,
           "Argument `strategy` must be a tf.distribute.Strategy"),
        # -- devices --------------------------------------------------------------------
        _c("virtual_devices", "keras_dist.virtual_devices(0)", ValueError,
           "Argument `n` must be an integer >= 1"),
        _c("virtual_devices", "keras_dist.virtual_devices(2.5)", ValueError,
           "Argument `n` must be an integer >= 1"),
        _c("virtual_devices", "keras_dist.virtual_devices(2, 'TPU')", ValueError,
           "`device_type`"),
        _c("virtual_devices", "keras_dist.virtual_devices(2, memory_limit_mb=0)", ValueError,
           "`memory_limit_mb` must be a positive integer"),
        # -- ClusterConfig.from_tf_config ---------------------------------------------------
        _c("ClusterConfig", "ClusterConfig.from_tf_config('{not json')", ClusterConfigError,
           "TF_CONFIG is not valid JSON"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config('[1, 2]')", ClusterConfigError,
           "must be a JSON object"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {}, 'tsk': {}})",
           ClusterConfigError, "unknown key(s) ['tsk']"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': []}, "
           "'task': {'type': 'worker', 'index': 0}})", ClusterConfigError, "has no workers"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': ['a:1', "
           "'b:2'], 'ps': ['c:3']}, 'task': {'type': 'worker', 'index': 0}})",
           ClusterConfigError, "ParameterServerStrategy"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': ['a:1', "
           "'b:2']}})", ClusterConfigError, "has no 'task' field"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': ['a:1', "
           "'b:2']}, 'task': {'type': 'worker'}})", ClusterConfigError, "has no 'index'"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': ['a:1', "
           "'b:2']}, 'task': {'type': 'worker', 'index': 2}})", ClusterConfigError,
           "out of range"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': ['a:1', "
           "'a:1']}, 'task': {'type': 'worker', 'index': 0}})", ClusterConfigError,
           "repeats address 'a:1'"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': ['a', "
           "'b:2']}, 'task': {'type': 'worker', 'index': 0}})", ClusterConfigError,
           "must be a 'host:port' string"),
        _c("ClusterConfig", "ClusterConfig.from_tf_config({'cluster': {'worker': ['a:0', "
           "'b:2']}, 'task': {'type': 'worker', 'index': 0}})", ClusterConfigError,
           "expected an integer in 1..65535"),
        # -- batching -------------------------------------------------------------------
        _c("global_batch_size", "keras_dist.global_batch_size(0)", ValueError,
           "Argument `per_replica` must be an integer >= 1"),
        _c("global_batch_size", "keras_dist.global_batch_size(32.0)", ValueError,
           "Argument `per_replica` must be an integer >= 1"),
        _c("per_replica_batch_size", "keras_dist.per_replica_batch_size(-8)", ValueError,
           "Argument `global_batch` must be an integer >= 1"),
        _c("scale_learning_rate", "keras_dist.scale_learning_rate(0)", ValueError,
           "`base_lr` must be a positive finite number"),
        _c("scale_learning_rate", "keras_dist.scale_learning_rate(float('nan'))", ValueError,
           "`base_lr` must be a positive finite number"),
        _c("scale_learning_rate", "keras_dist.scale_learning_rate(0.1, rule='cubic')",
           ValueError, "Argument `rule` must be one of"),
        _c("scale_learning_rate", "keras_dist.scale_learning_rate(0.1, base_batch=256)",
           ValueError, "needs `per_replica`"),
        # -- launch() / launch_script() / keras-dist launch ----------------------------------
        _c("launch", "launch('python train.py', 2)", ValueError,
           "`command` must be a non-empty list of strings"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 0)", ValueError,
           "Argument `num_workers` must be an integer >= 1. Received: num_workers=0"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2, max_restarts=-1)", ValueError,
           "Argument `max_restarts` must be an integer >= 0. Received: max_restarts=-1"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2, min_workers=3)", ValueError,
           "Argument `min_workers` must be at most the number of workers (2). Received: "
           "min_workers=3"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2, min_workers=0)", ValueError,
           "Argument `min_workers` must be an integer >= 1. Received: min_workers=0"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2, timeout=0)", ValueError,
           "Argument `timeout` must be a number > 0"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2, env={'SEED': 1})", ValueError,
           "`env` must map strings to strings"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2, preload='yes')", ValueError,
           "Argument `preload` must be True or False"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2, stall_timeout=-1)",
           ValueError, "Argument `stall_timeout` must be a number >= 0 (seconds) or None"),
        _c("launch", "launch([sys.executable, '-c', 'pass'], 2)", ValueError,
           "Environment variable KERAS_DIST_STALL_TIMEOUT must be a number of seconds >= 0",
           env={"KERAS_DIST_STALL_TIMEOUT": "soon"}),
        _c("launch_script", "launch_script('no_such_script.py')", FileNotFoundError,
           "'no_such_script.py' does not exist"),
        _c("launch_script", "launch_script(__file__, '--epochs 3')", ValueError,
           "`script_args` must be a sequence of strings"),
        _c("keras-dist launch", "keras_dist_cli('launch', '--workers', '0', 'train.py')",
           CommandLineError, "--workers: must be an integer >= 1, received 0"),
        _c("keras-dist launch", "keras_dist_cli('launch', '--workers', 'two', 'train.py')",
           CommandLineError, "expected an integer, received 'two'"),
        _c("keras-dist launch", "keras_dist_cli('launch', '--max-restarts', '-1', 'train.py')",
           CommandLineError, "--max-restarts: must be an integer >= 0, received -1"),
        _c("keras-dist launch", "keras_dist_cli('launch', '--workers', '2', '--min-workers', "
           "'3', 'train.py')", CommandLineError,
           "--min-workers (3) must be at most --workers (2)"),
        _c("keras-dist launch", "keras_dist_cli('launch', '--min-workers', '0', 'train.py')",
           CommandLineError, "--min-workers: must be an integer >= 1, received 0"),
        _c("keras-dist launch", "keras_dist_cli('launch', '--timeout', '0', 'train.py')",
           CommandLineError, "--timeout: must be > 0 seconds"),
        _c("keras-dist launch", "keras_dist_cli('launch', '--stall-timeout', '-5', "
           "'train.py')", CommandLineError, "--stall-timeout: must be >= 0 seconds"),
        _c("keras-dist launch", "keras_dist_cli('launch', __file__)", CommandLineError,
           "Environment variable KERAS_DIST_STALL_TIMEOUT must be a number of seconds >= 0",
           env={"KERAS_DIST_STALL_TIMEOUT": "-1"}),
        _c("keras-dist launch", "keras_dist_cli('launch', 'no_such_script.py')",
           CommandLineError, "script 'no_such_script.py' not found"),
        _c("keras-dist launch", "keras_dist_cli('launch')", CommandLineError,
           "the following arguments are required: SCRIPT"),
        _c("notebook_launcher", "keras_dist.notebook_launcher('train')", TypeError,
           "`fn` must be callable"),
        _c("notebook_launcher", "keras_dist.notebook_launcher(print, num_workers=0)",
           ValueError, "Argument `num_workers` must be an integer >= 1"),
        _c("notebook_launcher", "keras_dist.notebook_launcher(print, min_workers=3)",
           ValueError, "Argument `min_workers` must be at most the number of workers (2)"),
        _c("notebook_launcher", "keras_dist.notebook_launcher(print, preload=1)", ValueError,
           "Argument `preload` must be True or False"),
        _c("notebook_launcher", "keras_dist.notebook_launcher(print, max_restarts=-1)",
           ValueError, "Argument `max_restarts` must be an integer >= 0"),
        _c("notebook_launcher", "keras_dist.notebook_launcher(print, stall_timeout='5')",
           ValueError, "Argument `stall_timeout` must be a number >= 0 (seconds) or None"),
        _c("notebook_launcher", "keras_dist.notebook_launcher(print, args='abc')", ValueError,
           "Argument `args` must be a tuple or list"),
        # -- checkpointing ----------------------------------------------------------------
        _c("save_state", "keras_dist.checkpointing.save_state('model.keras', '/tmp/s')",
           TypeError, "save_state: argument `model` must be a keras.Model. Received: str"),
        _c("save_state", "keras_dist.checkpointing.save_state(stages[0], '/tmp/s')",
           ValueError, "has no variables yet. Build it first"),
        _c("save_state", "keras_dist.checkpointing.save_state(model, '')", ValueError,
           "save_state: argument `directory` must be a non-empty directory path"),
        _c("save_state", "keras_dist.checkpointing.save_state(model, __file__)", ValueError,
           "argument `directory` must be a directory, but"),
        _c("restore_state", "keras_dist.checkpointing.restore_state(model, '/nonexistent/s')",
           BackupError, "No complete keras_dist sharded state in '/nonexistent/s'"),
        _c("BackupAndRestore", "BackupAndRestore('')", ValueError,
           "`backup_dir` must be a non-empty directory path"),
        _c("BackupAndRestore", "BackupAndRestore(None)", TypeError,
           "`backup_dir` must be a directory path (str or os.PathLike)"),
        _c("BackupAndRestore", "BackupAndRestore(__file__)", ValueError,
           "`backup_dir` must be a directory, but"),
        _c("BackupAndRestore", "BackupAndRestore('/tmp/b', save_freq=0)", ValueError,
           "`save_freq` must be 'epoch' or an integer >= 1"),
        _c("BackupAndRestore", "BackupAndRestore('/tmp/b', save_freq='batch')", ValueError,
           "Received: save_freq='batch'"),
        _c("BackupAndRestore", "BackupAndRestore('/tmp/b', save_freq=True)", ValueError,
           "`save_freq` must be 'epoch' or an integer >= 1"),
        _c("BackupAndRestore", "BackupAndRestore('/tmp/b', delete_checkpoint='yes')",
           ValueError, "`delete_checkpoint` must be True or False"),
        _c("BackupAndRestore", "BackupAndRestore('/tmp/b', handle_sigterm=1)", ValueError,
           "`handle_sigterm` must be True or False"),
        _c("BackupAndRestore", "BackupAndRestore('/tmp/b', preemption_exit_code=256)",
           ValueError, "`preemption_exit_code` must be an integer in 0..255 or None"),
        _c("BackupAndRestore", "BackupAndRestore('/tmp/b', preemption_check_freq=0)",
           ValueError, "`preemption_check_freq` must be an integer >= 1"),
        _c("chief_path", "keras_dist.chief_path(None)", TypeError,
           "Argument `path` must be a path (str or os.PathLike)"),
        _c("chief_path", "keras_dist.chief_path(b'model.keras')", TypeError,
           "Argument `path` must be a path"),
        _c("chief_path", "keras_dist.chief_path('')", ValueError, "must be a non-empty path"),
        _c("verbose", "keras_dist.verbose(3)", ValueError,
           "Argument `chief` must be one of ['auto', 0, 1, 2]"),
        _c("verbose", "keras_dist.verbose(True)", ValueError, "Received: chief=True"),
        _c("ModelCheckpoint", "ModelCheckpoint(None)", TypeError,
           "Argument `filepath` must be a path"),
        _c("ModelCheckpoint", "ModelCheckpoint('ckpt.txt')", ValueError,
           "must end in `.keras`"),
        _c("TensorBoard", "TensorBoard(log_dir='')", ValueError,
           "Argument `log_dir` must be a non-empty path"),
    ]
    cases += _data_cases() + _callback_cases() + _planning_cases() + _parallel_cases()
    return cases


def _planning_cases() -> list[Case]:
    return [
        _c("planning.predict", "planning.predict(-5, 100.0)", ValueError,
           "params must be a number > 0, received -5"),
        _c("planning.predict", "planning.predict(25e6, 100.0, link_rate='10GB/s')", ValueError,
           "Unknown link rate '10GB/s': expected a number with a unit of bit, kbit"),
        _c("planning.predict", "planning.predict(25e6, 100.0, overlap=2)", ValueError,
           "overlap must be a number in [0, 1], received 2"),
        _c("planning.Link", "planning.Link.parse('1gbit', '50 parsecs')", ValueError,
           "Unknown duration '50 parsecs'"),
        _c("keras-dist plan", "keras_dist_cli('plan', '--params', '-3', '--step-ms', '10')",
           CommandLineError, "argument --params: must be > 0 parameters, received '-3'"),
        _c("keras-dist plan", "keras_dist_cli('plan', '--params', '1M', '--step-ms', '10', "
           "'--link-rate', '10gb')", CommandLineError, "argument --link-rate: Unknown link "
           "rate '10gb'"),
        _c("keras-dist bench allreduce", "keras_dist_cli('bench', 'allreduce', "
           "'--link-rate', 'fast')", CommandLineError, "argument --link-rate: Unknown link "
           "rate 'fast'"),
    ]


def _parallel_cases() -> list[Case]:
    return [
        _c("parallel.split_sequential", "parallel.split_sequential(object(), 2)", ValueError,
           "must be a keras.Sequential. Received: model='object'. For other models, build "
           "the stages yourself"),
        _c("parallel.split_sequential", "parallel.split_sequential(stages[0], 3)", ValueError,
           "Argument `num_stages` must be at most the number of layers (1)"),
        _c("parallel.split_sequential", "parallel.split_sequential(keras.Sequential("
           "[keras.layers.Dense(2), keras.layers.Dense(2)]), 2, balance=[2, 1])", ValueError,
           "Argument `balance` must be 'params' or 2 layer counts >= 1 summing to 2"),
        _c("parallel.PipelineModel", "parallel.PipelineModel([])", ValueError,
           "Argument `stages` must be a non-empty list of keras.Sequential"),
        _c("parallel.PipelineModel", "parallel.PipelineModel(stages, num_microbatches=0)",
           ValueError, "Argument `num_microbatches` must be an integer >= 1"),
        _c("parallel.PipelineModel", "parallel.PipelineModel(stages, remat='yes')", ValueError,
           "Argument `remat` must be True or False"),
        _c("parallel.PipelineModel", "parallel.PipelineModel(stages, devices=['/device:CPU:0'])",
           ValueError, "Got 1 devices for 2 stages"),
        _c("parallel.PipelineModel", "parallel.PipelineModel(stages, devices=['/device:CPU:0', "
           "'/device:GPU:7'])", ValueError, "'/device:GPU:7' does not exist; the devices are"),
        _c("parallel.ShardedDense", "parallel.ShardedDense(4, mode='diagonal')", ValueError,
           "Argument `mode` must be one of ['column', 'row']"),
        _c("parallel.ShardedDense", "parallel.ShardedDense(0)", ValueError,
           "Argument `units` must be an integer >= 1"),
    ]


def _data_cases() -> list[Case]:
    return [
        _c("distribute_dataset", "keras_dist.distribute_dataset(X, 0)", ValueError,
           "Argument `per_replica_batch_size` must be an integer >= 1"),
        _c("distribute_dataset", "keras_dist.distribute_dataset(X, 8, seed=-1)", ValueError,
           "Argument `seed` must be an integer >= 0"),
        _c("distribute_dataset", "keras_dist.distribute_dataset(X, 8, shuffle='yes')",
           TypeError, "Argument `shuffle` must be True or False"),
        _c("distribute_dataset", "keras_dist.distribute_dataset(X, 8, shuffle_buffer=0)",
           ValueError, "Argument `shuffle_buffer` must be an integer >= 1"),
        _c("distribute_dataset", "keras_dist.distribute_dataset(X, 8, map_fn=3)", TypeError,
           "Argument `map_fn` must be a function"),
        _c("distribute_dataset", "keras_dist.distribute_dataset(X, 8, feature_columns='x')",
           TypeError, "select columns of a Ray Data shard"),
        _c("distribute_dataset", "keras_dist.distribute_dataset((X, X[:5]), 8)", ValueError,
           "arrays of different lengths"),
        _c("distribute_dataset", "keras_dist.distribute_dataset({}, 8)", ValueError,
           "empty dict"),
        _c("distribute_dataset", "keras_dist.distribute_dataset(object(), 8)", TypeError,
           "Argument `source` must be NumPy arrays"),
        _c("distribute_dataset", "keras_dist.distribute_dataset('/no/such/*.tfrecord', 8)",
           ValueError, "matches no file"),
        _c("steps_per_epoch", "keras_dist.steps_per_epoch([1, 2])", TypeError,
           "Argument `dataset` must come from keras_dist.distribute_dataset"),
    ]


def _callback_cases() -> list[Case]:
    return [
        _c("GradientAggregation", "callbacks.GradientAggregation(clipnorm=-1.0)", ValueError,
           "`clipnorm`"),
        _c("GradientAggregation", "callbacks.GradientAggregation(compression='fp8')",
           ValueError, "`compression`"),
        _c("GradientAggregation", "callbacks.GradientAggregation(accumulation_steps=0)",
           ValueError, "`accumulation_steps`"),
        _c("GradientNormLogger", "callbacks.GradientNormLogger(update_freq='step')", ValueError,
           "`update_freq`"),
        _c("ReplicaSyncCheck", "callbacks.ReplicaSyncCheck(every_n_batches=0)", ValueError,
           "`every_n_batches`"),
        _c("LearningRateWarmup", "callbacks.LearningRateWarmup()", ValueError, "exactly one"),
        _c("LearningRateWarmup", "callbacks.LearningRateWarmup(warmup_steps=0)", ValueError,
           "`warmup_steps`"),
        _c("Throughput", "callbacks.Throughput(global_batch_size=0)", ValueError,
           "`global_batch_size`"),
        _c("StepTimeMonitor", "callbacks.StepTimeMonitor(every_n_steps=0)", ValueError,
           "Argument `every_n_steps` must be an integer >= 1"),
        _c("StepTimeMonitor", "callbacks.StepTimeMonitor(straggler_ratio=1)", ValueError,
           "Argument `straggler_ratio` must be a number > 1"),
        _c("Profiler", "callbacks.Profiler('x', steps=(0, 2))", ValueError,
           "Argument `steps` must be a pair (a, b) of integers with 1 <= a <= b"),
        # -- keras.distribution on TensorFlow (the mesh-dependent ones: MESH_CASES below) --
        _c("keras.distribution", "keras.distribution.initialize('127.0.0.1:1111', 2, 0)",
           ValueError, "job_addresses must list every process's 'host:port'"),
        _c("keras.distribution", "keras.distribution.initialize("
           "'127.0.0.1:1111,127.0.0.1:1112', 2, 2)", ValueError,
           "process_id must be in 0..1"),
    ]


def _namespace() -> dict:
    import numpy as np

    import keras_dist
    from keras_dist import ClusterConfig, callbacks, planning
    from keras_dist.checkpointing import (BackupAndRestore, ModelCheckpoint, TensorBoard)
    from keras_dist.launching.local import launch, launch_script

    import keras

    from keras_dist import parallel

    return {
        "keras_dist": keras_dist, "ClusterConfig": ClusterConfig, "callbacks": callbacks,
        "BackupAndRestore": BackupAndRestore, "ModelCheckpoint": ModelCheckpoint,
        "TensorBoard": TensorBoard, "launch": launch, "launch_script": launch_script,
        "keras_dist_cli": keras_dist_cli, "sys": sys, "__file__": __file__,
        "X": np.zeros((16, 4), dtype="float32"), "planning": planning,
        "keras": keras, "parallel": parallel,
        "stages": [keras.Sequential([keras.layers.Dense(2)]) for _ in range(2)],
        "model": keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
    }


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.api}: {c.call}" for c in CASES])
@pytest.mark.multiworker
def test_bad_input_is_refused_clearly(case, monkeypatch):
    for name, value in (case.env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    namespace = _namespace()
    with pytest.raises(case.error) as error_info:
        eval(case.call, namespace)  # noqa: S307 - the table's own, fixed expressions
    assert type(error_info.value) is case.error  # not merely a subclass
    assert case.fragment in str(error_info.value)
    if case.error is CommandLineError:
        assert str(error_info.value).startswith("exit 2: usage: keras-dist")  # argparse's


def render_markdown() -> str:
    lines = [
        "# Bad inputs and what keras_dist says",
        "",
        "Every row is checked by `tests/test_bad_inputs.py` (the table is generated from "
        "it: `python tests/test_bad_inputs.py > docs/bad_inputs.md`). Messages name the "
        "argument, the value received and what is expected; the fragment below is part "
        "of the message. `X` is a NumPy array of 16 examples; `keras_dist_cli(...)` runs "
        "the `keras-dist` command line (it exits with the code shown and prints the "
        "message to stderr); `callbacks` is `keras_dist.callbacks`, and "
        "`BackupAndRestore`, `ModelCheckpoint`, `TensorBoard` are "
        "`keras_dist.checkpointing`'s; `parallel` is `keras_dist.parallel` and `stages` "
        "two unbuilt one-layer `keras.Sequential`.",
        "",
        "| API | Call | Raises | Message contains | Environment |",
        "|---|---|---|---|---|",
    ]

    def cell(text):
        return text.replace("|", "\\|")

    def code(text):
        # A double-backtick span may contain single backticks (the messages quote names).
        return f"`` {cell(text)} ``" if "`" in text else f"`{cell(text)}`"

    for case in CASES:
        error = "exit code 2" if case.error is CommandLineError else case.error.__name__
        env = ", ".join(
            f"`{name}` unset" if value is None
            else f"`{name}`: 2 workers, this is worker 0" if value == TWO_WORKERS
            else f"`{name}={value}`"
            for name, value in (case.env or {}).items()
        )
        lines.append(f"| {cell(case.api)} | {code(case.call)} | {error} | "
                     f"{code(case.fragment)} | {cell(env)} |")
    from test_keras_distribution import MESH_CASES

    lines += [
        "",
        "## keras.distribution on TensorFlow: layouts, meshes and batches",
        "",
        "These need a mesh of devices; `tests/test_keras_distribution.py` checks each on 4 "
        "virtual CPUs (`test_bad_input_is_a_clear_value_error`). Each is a `ValueError` "
        "naming the variable path, its shape, the layout and the mesh (or the batch and "
        "the batch axis).",
        "",
        "| What the user did | Raises | Message contains |",
        "|---|---|---|",
    ]
    for _, situation, fragments in MESH_CASES:
        lines.append(f"| {cell(situation)} | ValueError | "
                     f"{', '.join(code(fragment) for fragment in fragments)} |")
    from test_fsdp import FSDP_CASES

    lines += [
        "",
        "### `keras_dist.distribution.FSDP`",
        "",
        "`tests/test_fsdp.py` checks each on 4 virtual CPUs "
        "(`test_fsdp_bad_input_is_a_clear_error`); each is a `ValueError`.",
        "",
        "| What the user did | Raises | Message contains |",
        "|---|---|---|",
    ]
    for _, situation, fragments in FSDP_CASES:
        lines.append(f"| {cell(situation)} | ValueError | "
                     f"{', '.join(code(fragment) for fragment in fragments)} |")
    return "\n".join(lines) + "\n"


def test_docs_table_is_current():
    with open(DOCS_PAGE) as file:
        assert file.read() == render_markdown(), (
            "docs/bad_inputs.md is out of date: run "
            "`python tests/test_bad_inputs.py > docs/bad_inputs.md`")


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
