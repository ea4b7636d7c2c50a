"""Progress from Keras's own loops: every `fit`, `evaluate` and `predict` reports to
`keras_dist.stall.progress`, whatever callbacks the user passed.

Keras's trainers drive every loop through `keras.callbacks.CallbackList` (they wrap the
user's callbacks in one, or take the user's own), calling its public hooks in a fixed
order: `on_train_begin`, `on_epoch_begin`, `on_train_batch_begin`, the step,
`on_train_batch_end`, ..., `on_test_*` for validation, `on_epoch_end`, `on_train_end`.
`install()` wraps those public methods on the class, once: each hook records one event
before it runs the user's callbacks (so a callback that never returns is seen *in* that
hook) and where the loop is once they returned (a batch hook returning means the step is
running). A loop that raises never reaches its end hook, so `keras.Model`'s `fit`,
`evaluate` and `predict` are wrapped too: whatever way they return, the loops they began
are over (else a process that caught the error would count as "in fit" while idle). The
first `fit`/`evaluate`/`predict` of a process starts the reporter
(`keras_dist.stall.reporter`). Cost per batch: a few attribute stores, no I/O.
"""

from __future__ import annotations

import functools

from keras_dist.stall import progress as _progress
from keras_dist.stall import reporter

__all__ = ["install", "installed"]

_MARK = "_keras_dist_progress"
_LOOPS = {"on_train_begin": "fit", "on_test_begin": "evaluate", "on_predict_begin": "predict"}
_LOOP_ENDS = ("on_train_end", "on_test_end", "on_predict_end")
_BATCH_BEGINS = {"on_train_batch_begin": "train step", "on_test_batch_begin": "evaluation",
                 "on_predict_batch_begin": "predict"}
_BATCH_ENDS = {"on_train_batch_end": True, "on_test_batch_end": False,
               "on_predict_batch_end": False}
HOOKS = (*_LOOPS, *_LOOP_ENDS, *_BATCH_BEGINS, *_BATCH_ENDS, "on_epoch_begin",
         "on_epoch_end")
ENTRIES = ("fit", "evaluate", "predict")


def _first_step(callbacks) -> int | None:
    """The optimizer's iterations as `fit` takes its first step (after a restore)."""
    try:
        return int(callbacks.model.optimizer.iterations.numpy())
    except Exception:  # no optimizer yet, or a value this cannot read: count from 0
        return None


def _before(name: str, callbacks, progress) -> None:
    if name in _LOOPS:
        reporter.ensure_started()
        progress.loop_began(_LOOPS[name])
    elif name in _BATCH_BEGINS:
        if name == "on_train_batch_begin" and progress.in_first_batch:
            progress.step_is(_first_step(callbacks))
        progress.batch_began()
    elif name in _BATCH_ENDS:
        progress.batch_ended(train=_BATCH_ENDS[name])
    elif name == "on_epoch_begin":
        progress.epoch_began()
    progress.event("callbacks", name)


def _after(name: str, progress) -> None:
    if name in _LOOP_ENDS:
        progress.loop_ended()
    if name in _BATCH_BEGINS:
        progress.where(_BATCH_BEGINS[name])
    elif name in _LOOPS and name != "on_train_begin":
        progress.where("evaluation" if name == "on_test_begin" else "predict")
    elif name == "on_train_begin":
        progress.where("start-up", "before the first train step")
    elif progress.loop is None:
        progress.where(_progress.OUTSIDE)
    else:
        progress.where("between steps", progress.loop)


def _wrap(name: str, method):
    @functools.wraps(method)
    def hooked(self, *args, **kwargs):
        progress = _progress.current()
        _before(name, self, progress)
        try:
            return method(self, *args, **kwargs)
        finally:
            _after(name, progress)

    setattr(hooked, _MARK, method)
    return hooked


def _wrap_entry(method):
    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        progress = _progress.current()
        depth = progress.depth
        try:
            return method(self, *args, **kwargs)
        finally:
            progress.loops_ended_to(depth)
            if depth == 0:
                reporter.publish_now()  # outside Keras loops: say so before an exit

    setattr(entry, _MARK, method)
    return entry


def install() -> None:
    """Wraps `keras.callbacks.CallbackList`'s loop hooks and `keras.Model`'s loops (once;
    Keras must be imported)."""
    import keras

    cls = keras.callbacks.CallbackList
    for name in HOOKS:
        method = cls.__dict__.get(name) or getattr(cls, name)
        if not hasattr(method, _MARK):
            setattr(cls, name, _wrap(name, method))
    for name in ENTRIES:
        method = getattr(keras.Model, name)
        if not hasattr(method, _MARK):
            setattr(keras.Model, name, _wrap_entry(method))


def installed() -> bool:
    import keras

    return (all(hasattr(getattr(keras.callbacks.CallbackList, name), _MARK) for name in HOOKS)
            and all(hasattr(getattr(keras.Model, name), _MARK) for name in ENTRIES))
