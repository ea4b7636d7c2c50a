"""The public API: declared once in keras_dist/__init__.py, and every name of the contract
(DESIGN.md's "Public API", the README) resolves after `import keras_dist` alone."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import keras_dist

# DESIGN.md "Public API (names to keep stable)"; the launcher's library form is
# `keras_dist.launching` (one name per thing: the old `keras_dist.launch` and
# `keras_dist.notebook` module paths are gone).
CONTRACT = [
    "strategy", "resolve_strategy", "ClusterConfig.from_env", "ClusterConfigError",
    "virtual_devices", "physical_devices", "local_devices",
    "is_chief", "worker_index", "num_workers",
    "global_batch_size", "per_replica_batch_size", "scale_learning_rate",
    "distribute_dataset", "steps_per_epoch", "chief_path", "verbose",
    "callbacks.GradientAggregation", "callbacks.GradientNormLogger",
    "callbacks.ReplicaSyncCheck", "callbacks.LearningRateWarmup", "callbacks.Throughput",
    "callbacks.StepTimeMonitor", "callbacks.Profiler", "callbacks.BackupAndRestore",
    "callbacks.ModelCheckpoint", "callbacks.TensorBoard",
    "checkpointing.BackupAndRestore", "checkpointing.chief_path",
    "notebook_launcher", "WorkerError", "launching.notebook_launcher", "barrier",
    "parallel.split_sequential", "parallel.PipelineModel", "parallel.ShardedDense",
    "parallel.ShardedEmbedding", "launching.launch", "launching.launch_script",
    "testing.run_on_workers", "testing.run_in_subprocess", "aggregation.install",
    "compat.registry",
]

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_names():
    names = set(re.findall(r"\bkeras_dist\.([A-Za-z_][\w.]*[A-Za-z_0-9])", README.read_text()))
    # `keras_dist.integrations.ray` needs the optional `ray` extra; its package resolves.
    return sorted(name.replace("integrations.ray", "integrations") for name in names)


@pytest.mark.multiworker
def test_every_contract_and_readme_name_resolves_after_import_keras_dist_alone():
    # A fresh interpreter: nothing but `import keras_dist` may have run before.
    names = sorted(set(CONTRACT) | set(_readme_names()))
    code = (
        "import functools, keras_dist\n"
        f"for name in {names!r}:\n"
        "    functools.reduce(getattr, name.split('.'), keras_dist)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_public_api_is_one_table():
    # __all__, dir() and attribute access agree, all derived from the one table.
    assert keras_dist.__all__ == list(keras_dist._PUBLIC)
    assert set(keras_dist.__all__) <= set(dir(keras_dist))
    for name in ("callbacks", "checkpointing", "launching", "aggregation", "data"):
        assert getattr(keras_dist, name).__name__ == f"keras_dist.{name}"
    assert keras_dist.strategy is keras_dist.strategies.strategy
    assert keras_dist.chief_path is keras_dist.checkpointing.chief_path


def test_each_public_module_declares_only_names_it_has():
    for name, module_name in keras_dist._PUBLIC.items():
        if module_name != f"keras_dist.{name}":
            continue
        module = getattr(keras_dist, name)
        for exported in getattr(module, "__all__", ()):
            assert hasattr(module, exported), f"keras_dist.{name}.__all__ lists {exported!r}"
