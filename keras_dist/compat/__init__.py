"""keras_dist's compatibility layer: upstream fixes, each gated by a probe of its bug.

This package is the only place keras_dist patches Keras/TensorFlow or reaches into their
private symbols. Two parts:

* **Fixes** (`FIXES`): each names its upstream issue and has a probe that reads
  upstream's own code (or checks its behaviour) and answers `present`, `fixed` or
  `unknown`. `apply()` installs the fixes whose bug is present - also on a Keras newer
  than any keras_dist was tested with - skips those upstream fixed, and installs those
  it cannot decide about with a one-time warning naming the fix (each fix is harmless
  where the bug is absent). No version ceilings: a `< 3.16` gate once switched every
  fix off on keras-nightly while the bugs were still there.
* **The registry** (`registry.INTERNALS`): every private symbol keras_dist uses, why,
  and a check; `check("aggregation")` raises `CompatError` naming any that is missing
  or changed, at `keras_dist.strategy()` / `aggregation.install()` time.

`KERAS_DIST_DISABLE_COMPAT=name[,name]` (or `all`) turns fixes off, e.g. to see whether
an upstream release fixed a bug; `revert()` undoes every patch (for tests).

Example:
    >>> from keras_dist import compat
    >>> sorted(compat.probe_report())  # doctest: +SKIP
    ['loss_scale_finite_across_replicas', 'reduce_per_replica_scalar', ...]
"""

from __future__ import annotations

import os
import threading
import warnings

from keras_dist.compat import (
    _patch, _probe, build_without_call, input_epoch, keras_distribution, loss_scale,
    one_iterator_per_epoch, optimizer_options, reduce_per_replica, registry,
    sparse_duplicates, step_loss_scale, symbolic_build, writers,
)
from keras_dist.compat._fix import Fix
from keras_dist.compat._keras_tf import keras_version
from keras_dist.compat._probe import FIXED, PRESENT, UNKNOWN
from keras_dist.compat.registry import CompatError, check

__all__ = [
    "FIXES", "Fix", "CompatError", "PRESENT", "FIXED", "UNKNOWN",
    "apply", "applied", "revert", "probe_report", "check", "keras_version",
]

FIXES: tuple[Fix, ...] = (
    symbolic_build.FIX, build_without_call.FIX, reduce_per_replica.FIX,
    step_loss_scale.FIX, loss_scale.FIX,
    # Before the clip fix: it wraps the `_clip_gradients` this one installs.
    sparse_duplicates.FIX, optimizer_options.CLIP_FIX,
    optimizer_options.CONDS_FIX, writers.FIX, input_epoch.FIX, one_iterator_per_epoch.FIX,
    keras_distribution.FIX,
)

_lock = threading.Lock()
_applied: dict[str, bool] = {}
_warned: set[str] = set()


def _disabled() -> set[str]:
    value = os.environ.get("KERAS_DIST_DISABLE_COMPAT", "")
    return {name.strip() for name in value.split(",") if name.strip()}


def probe_report() -> dict[str, str]:
    """{fix name: "present" | "fixed" | "unknown"} for this Keras/TensorFlow."""
    return {fix.name: fix.probe() for fix in FIXES}


def _warn_unknown(fix: Fix) -> None:
    if fix.name in _warned:
        return
    _warned.add(fix.name)
    warnings.warn(
        f"keras_dist cannot tell whether this Keras ({_versions()}) still has the bug "
        f"that fix {fix.name!r} works around ({fix.upstream}); applying the fix, which "
        "is harmless if the bug is gone. Set KERAS_DIST_DISABLE_COMPAT="
        f"{fix.name} to turn it off.",
        RuntimeWarning,
        stacklevel=3,
    )


def _versions() -> str:
    from keras_dist.compat._keras_tf import versions

    return versions()


def apply(names=None) -> list[str]:
    """Applies, once, every fix whose bug this Keras/TF has (or those `names`).

    Returns the names applied so far.
    """
    with _lock:
        disabled = _disabled()
        for fix in FIXES:
            if fix.name in _applied or names is not None and fix.name not in names:
                continue
            if "all" in disabled or fix.name in disabled:
                _applied[fix.name] = False
                continue
            verdict = fix.probe()
            if verdict == FIXED:
                _applied[fix.name] = False
                continue
            broken = registry.problems(names=fix.symbols)
            if broken:
                raise CompatError(registry._message(
                    f"apply fix {fix.name!r} ({fix.upstream})", broken,
                    f"Set KERAS_DIST_DISABLE_COMPAT={fix.name} to run without the fix "
                    "(only if this Keras no longer has the bug). ",
                ))
            if verdict == UNKNOWN:
                _warn_unknown(fix)
            fix.apply()
            _applied[fix.name] = True
        return [name for name, on in _applied.items() if on]


def applied() -> dict[str, bool]:
    """Which fixes were considered in this process and whether each was applied."""
    return dict(_applied)


def revert(name: str | None = None) -> list[str]:
    """Undoes every fix, or the one named (for tests); the next `apply()` probes and
    applies again."""
    with _lock:
        if name is None:
            _applied.clear()
        else:
            _applied.pop(name, None)
        return _patch.revert(name)
