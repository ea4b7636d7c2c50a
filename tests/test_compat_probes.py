"""Probe-gated fixes and the internals registry (keras_dist.compat).

Each probe must find its bug in the Keras installed here (3.15.1, and the pinned
keras-nightly in CI's nightly lane), and say "fixed" for a patched copy of upstream's
code without the bug - then `apply()` must leave upstream alone. A registry symbol that
disappears must be a clear CompatError naming it and the Keras version.
"""

from __future__ import annotations

import inspect
import os
import re
import textwrap
import warnings

import pytest

keras = pytest.importorskip("keras")

from keras_dist import compat  # noqa: E402
from keras_dist.compat import _keras_tf, _patch, registry  # noqa: E402
from keras_dist.compat._internals import _base_trainer  # noqa: E402


@pytest.fixture()
def clean_compat(monkeypatch):
    """Upstream Keras without keras_dist's patches.

    Torn down before `monkeypatch` (it depends on it), so a test's own replacement of an
    upstream symbol is reverted first and monkeypatch then restores upstream. The next
    `keras_dist.strategy()` or `install()` applies the fixes again.
    """
    compat.revert()
    registry._checked.clear()
    compat._warned.clear()
    yield
    compat.revert()
    registry._checked.clear()


def _patched_copy(function, bug: str, replacement: str):
    """Upstream `function` recompiled with its bug pattern replaced: a fixed upstream."""
    source = textwrap.dedent(inspect.getsource(function))
    fixed, count = re.subn(bug, replacement, source)
    assert count, f"bug pattern {bug!r} not found in upstream {function.__qualname__}"
    namespace = dict(function.__globals__)
    code = compile(fixed, inspect.getsourcefile(function), "exec")
    exec(code, namespace)
    copy = namespace[function.__name__]
    # linecache cannot show the recompiled text; make the probe read it from here.
    copy.__wrapped__ = None
    return copy, fixed


# (fix module, owner, attribute the probe reads, raw-source bug regex, replacement)
CASES = {
    "symbolic_build_multi_worker": (
        _keras_tf.trainer_class, "_maybe_symbolic_build",
        r"self\.distribute_strategy\.reduce\(\s*\"MEAN\",",
        "self.distribute_strategy.experimental_local_results_first(",
    ),
    "reduce_per_replica_scalar": (
        _keras_tf.trainer_module, "reduce_per_replica",
        r"strategy\.reduce\(\"MEAN\", v, axis=0\)",
        "strategy.reduce(\"MEAN\", v, axis=None)",
    ),
    "loss_scale_finite_across_replicas": (
        _keras_tf.loss_scale_optimizer_class, "_tf_apply",
        r"distribution\.experimental_local_results\(\s*finite_per_replica\s*\)\[0\]",
        "distribution.reduce('MIN', finite_per_replica, axis=None)",
    ),
    "clip_after_all_reduce": (
        _keras_tf.tf_optimizer_class, "_all_reduce_sum_gradients",
        r"return reduced_with_nones",
        "return self._clip_gradients_after_reduce(reduced_with_nones)",
    ),
    # A fixed upstream would sum a sparse gradient's repeated ids before `update_step`.
    "sparse_duplicates_summed": (
        _keras_tf.tf_optimizer_class, "_distributed_tf_update_step",
        r"return self\.update_step\(grad, var, learning_rate\)",
        "return self.update_step(_deduplicate_sparse(grad), var, learning_rate)",
    ),
    "optimizer_conds_cross_replica": (
        _keras_tf.tf_optimizer_class, "_backend_apply_gradients",
        r"ops\.cond\(",
        "cross_replica_cond(",
    ),
    # A fixed upstream would stop scaling losses for a SUM all-reduce.
    "custom_step_loss_scale": (
        lambda: __import__("keras.src.losses.loss", fromlist=["loss"]),
        "scale_loss_for_distribution",
        r"1\.0 / num_replicas",
        "1.0",
    ),
    # A fixed upstream would not trace call() for a model that has none.
    "build_models_without_call": (
        lambda: _base_trainer(), "_symbolic_build",
        r"y_pred = backend\.compute_output_spec\(self, x, training=False\)",
        "y_pred = (None if type(self).call is __import__('keras').Model.call else "
        "backend.compute_output_spec(self, x, training=False))",
    ),
    # A fixed upstream would tell its input which epoch begins.
    "input_epoch": (
        lambda: __import__("keras_dist.compat._internals",
                           fromlist=["_internals"])._epoch_iterator(),
        "_enumerate_iterator",
        r"self\.data_adapter\.on_epoch_begin\(\)",
        "self.data_adapter.on_epoch_begin(epoch=self._steps_seen)",
    ),
    # A fixed upstream would leave the next epoch to make its own iterator.
    "one_iterator_per_epoch": (
        lambda: __import__("keras_dist.compat._internals",
                           fromlist=["_internals"])._epoch_iterator(),
        "_enumerate_iterator",
        r"self\._current_iterator = iter\(self\._get_iterator\(\)\)(\s+self\._steps_seen = 0"
        r"\s+else:)",
        r"self._current_iterator = None\1",
    ),
    "stock_writers_multi_worker": (
        lambda: keras.callbacks.ModelCheckpoint, "_save_model",
        r"self\.model\.save_weights\(filepath, overwrite=True\)",
        "self.model.save_weights(write_filepath(filepath), overwrite=True)",
    ),
}


def _fix(name):
    return {fix.name: fix for fix in compat.FIXES}[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_probe_finds_the_bug_in_installed_keras(name):
    assert _fix(name).probe() == compat.PRESENT


class _SourceFromString:
    """Lets `inspect.getsource` read a recompiled function's text."""

    def __init__(self, function, text):
        self.function, self.text = function, text

    def __enter__(self):
        import linecache

        filename = f"<keras_dist patched {self.function.__name__}>"
        self.function.__code__ = self.function.__code__.replace(co_filename=filename)
        linecache.cache[filename] = (len(self.text), None, self.text.splitlines(True),
                                     filename)
        return self.function

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", sorted(CASES))
def test_probe_says_fixed_for_a_patched_upstream_and_apply_skips_the_fix(
        name, clean_compat, monkeypatch):
    owner_fn, attribute, bug, replacement = CASES[name]
    owner = owner_fn()
    upstream = getattr(owner, attribute)
    copy, text = _patched_copy(upstream, bug, replacement)
    del copy.__wrapped__
    with _SourceFromString(copy, text):
        fix = _fix(name)
        assert fix.probe() == compat.PRESENT
        assert fix.probe(copy) == compat.FIXED
        monkeypatch.setattr(owner, attribute, copy)
        assert fix.probe() == compat.FIXED
        compat.apply()
        assert compat.applied()[name] is False
        # Upstream's (fixed) code is left exactly as it is.
        assert getattr(owner, attribute) is copy


def test_apply_installs_fixes_and_revert_restores_upstream(clean_compat):
    trainer = _keras_tf.trainer_class()
    upstream = trainer.__dict__["_maybe_symbolic_build"]
    applied = compat.apply()
    assert set(applied) == set(CASES) | {"keras_distribution_on_tensorflow"}
    assert trainer.__dict__["_maybe_symbolic_build"] is not upstream
    # The probe reads upstream's code, not keras_dist's wrapper.
    assert _fix("symbolic_build_multi_worker").probe() == compat.PRESENT
    compat.revert()
    assert trainer.__dict__["_maybe_symbolic_build"] is upstream
    assert compat.applied() == {}


def test_a_strategy_asked_for_again_puts_reverted_fixes_back(clean_compat):
    import keras_dist

    keras_dist.strategy()
    compat.revert("input_epoch")
    assert "input_epoch" not in compat.applied()
    keras_dist.strategy()  # the strategy made above, from the cache
    assert compat.applied()["input_epoch"] is True


def test_an_undecidable_probe_warns_once_naming_the_fix_and_applies_it(
        clean_compat, monkeypatch):
    module = _keras_tf.trainer_module()
    # A function whose code cannot be read (built from a string): the probe cannot tell.
    namespace = {}
    exec("def reduce_per_replica(values, strategy, reduction):\n    return values\n",
         namespace)
    monkeypatch.setattr(module, "reduce_per_replica", namespace["reduce_per_replica"])
    with pytest.warns(RuntimeWarning, match="reduce_per_replica_scalar"):
        compat.apply()
    assert compat.applied()["reduce_per_replica_scalar"] is True
    compat.revert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.apply()  # warned once per process already


def test_disabling_a_fix_by_environment_leaves_upstream_alone(clean_compat, monkeypatch):
    monkeypatch.setenv("KERAS_DIST_DISABLE_COMPAT", "reduce_per_replica_scalar")
    module = _keras_tf.trainer_module()
    upstream = module.reduce_per_replica
    compat.apply()
    assert compat.applied()["reduce_per_replica_scalar"] is False
    assert module.reduce_per_replica is upstream


def test_every_registered_internal_is_present_in_installed_keras():
    assert registry.problems() == {}
    for fix in compat.FIXES:
        for symbol in fix.symbols:
            registry.get(symbol)  # every patched symbol is registered


def test_a_renamed_internal_is_a_clear_error_naming_it_and_the_keras_version(
        clean_compat, monkeypatch):
    tf_optimizer = _keras_tf.tf_optimizer_class()

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        grads_and_vars = self._all_reduce_sum_gradients_renamed(
            list(zip(grads, trainable_variables)))
        return grads_and_vars

    monkeypatch.setattr(tf_optimizer, "_backend_update_step", _backend_update_step)
    with pytest.raises(compat.CompatError) as caught:
        compat.check("aggregation")
    message = str(caught.value)
    assert "keras.TFOptimizer._all_reduce_sum_gradients" in message
    assert f"Keras {keras.__version__}" in message
    from keras_dist import aggregation

    optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(compat.CompatError, match="_all_reduce_sum_gradients"):
        aggregation.install(optimizer)


def test_a_missing_patched_symbol_is_a_clear_error_from_apply(clean_compat, monkeypatch):
    lso = _keras_tf.loss_scale_optimizer_class()
    monkeypatch.delattr(lso, "check_finite")
    with pytest.raises(compat.CompatError, match="KERAS_DIST_DISABLE_COMPAT="
                       "loss_scale_finite_across_replicas"):
        compat.apply()


def test_patch_remembers_upstream_once():
    class Owner:
        def method(self):
            return "upstream"

    def first(self):
        return "first"

    def second(self):
        return "second"

    _patch.patch(Owner, "method", first, fix="t")
    _patch.patch(Owner, "method", second, fix="t")
    assert _patch.original(Owner, "method")(None) == "upstream"
    assert Owner().method() == "second"
    assert _patch.revert("t") == ["Owner.method"]
    assert Owner().method() == "upstream"


@pytest.mark.multiworker
@pytest.mark.slow
def test_a_changed_startup_internal_is_named_at_import_under_a_multi_worker_job():
    """startup.early_init's TensorFlow internals are registered; a missing one is named."""
    import json
    import subprocess
    import sys

    script = (
        "import warnings\n"
        "from tensorflow.python.eager import context\n"
        "del context.Context.configure_collective_ops\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import keras_dist\n"
        "print([str(w.message) for w in caught if 'could not prepare' in str(w.message)])\n"
    )
    tf_config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                 "task": {"type": "worker", "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tf.context.configure_collective_ops" in done.stdout, done.stdout
    assert registry.problems(groups=["startup"]) == {}


def test_keras_distribution_probe_finds_keras_tf_prototype_and_steps_aside_for_a_real_one():
    import types

    from keras_dist.compat import keras_distribution

    fix = _fix("keras_distribution_on_tensorflow")
    assert fix.probe() == compat.PRESENT  # the installed Keras's TF distribution_lib
    complete = types.ModuleType("distribution_lib", "Keras's TF distribution_lib, shipped.")
    for name in keras_distribution._BACKEND_FUNCTIONS:
        setattr(complete, name, lambda *args, **kwargs: None)
    assert keras_distribution.probe(complete) == compat.FIXED
    complete.__doc__ = "!!!DO NOT USE!!! a prototype"
    assert keras_distribution.probe(complete) == compat.PRESENT
    del complete.__doc__, complete.distribute_data_input
    assert keras_distribution.probe(complete) == compat.PRESENT
