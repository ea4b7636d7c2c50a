"""Fix: Keras 3 and TensorFlow's stock writers race when every worker saves to one path.

tensorflow/tensorflow#31070, #38635 (tf_keras redirected other workers' writes with
`distributed_file_utils`; Keras 3 has no such logic). Under MultiWorkerMirroredStrategy
every worker runs the same script, so on a shared filesystem `model.save`,
`model.save_weights`, `ModelCheckpoint` (HDF5 lock errors, `Bad CRC-32` zips),
`BackupAndRestore` (`FileExistsError`), `tf.train.Checkpoint.save`/`write` and
`tf.saved_model.save`/`model.export` ("MergeV2Checkpoints ... did not exist") collide.

The patches route each writer through `keras_dist.checkpointing.stock_writers.write` (the protocol: the
chief writes atomically to the real path, the others to removed temporaries, everyone
returns once the chief's file is complete). They act only while a multi-worker strategy
made by `keras_dist.strategy()` exists and `KERAS_DIST_STOCK_WRITERS` is not `0`;
otherwise every patched function is upstream's, called unchanged.
"""

from __future__ import annotations

import functools
import os
import re
import sys

from keras_dist.compat import _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "stock_writers_multi_worker"


def _writers():
    """keras_dist.checkpointing.stock_writers (imported on use: it imports Keras, and this
    package is imported when Keras is, by `keras_dist.startup.keras_hook`)."""
    from keras_dist.checkpointing import stock_writers

    return stock_writers


def _is_chief() -> bool:
    from keras_dist import _runtime

    return _runtime.is_chief()


def _path_or_none(path):
    try:
        path = os.fspath(path)
    except TypeError:
        return None
    return path if isinstance(path, str) and path else None


def _model_class():
    import keras

    return keras.Model


def _checkpoint_class():
    from tensorflow.python.checkpoint import checkpoint

    return checkpoint.Checkpoint


def _saved_model_modules():
    """TensorFlow's modules that define `tf.saved_model.save` and `tf.saved_model.load`."""
    from tensorflow.python.saved_model import load, save

    return save, load


def _patch_function(defining_module, name: str, replacement) -> None:
    """Replaces `defining_module.name` and every loaded TensorFlow module's copy of it.

    TensorFlow's public API modules (`tf.saved_model`, `tf.compat.v2.saved_model`, ...)
    copy the function from its defining module when they are loaded, and TensorFlow may
    load a fresh copy of one later: the first `import tensorflow.saved_model...` (Keras'
    `model.export` runs `from tensorflow.saved_model.experimental import ...`) loads
    `tensorflow.saved_model` anew and rebinds `tf.saved_model` to it. Patching only
    `tf.saved_model` then silently ends after the first export (issue 10: on 2 workers
    both wrote one SavedModel directory, and a load mixed the two saves' files). A
    module loaded later copies the replacement from the defining module.
    """
    original = _patch.original(defining_module, name)
    owners = [defining_module]
    for module_name, module in list(sys.modules.items()):
        # __dict__, not getattr: a lazy module must not be loaded by looking.
        namespace = getattr(module, "__dict__", None)
        if (module is not None and module is not defining_module
                and module_name.startswith("tensorflow") and isinstance(namespace, dict)
                and namespace.get(name) is original):
            owners.append(module)
    for owner in owners:
        _patch.patch(owner, name, replacement, fix=NAME)


def _file_utils():
    from keras.src.utils import file_utils

    return file_utils


def probe(function=None) -> str:
    """PRESENT while Keras' ModelCheckpoint saves without asking which worker it is on."""
    if function is None:
        import keras

        function = _patch.original(keras.callbacks.ModelCheckpoint, "_save_model")
    source = _probe.source_of(function)
    if source is None:
        return _probe.UNKNOWN
    if re.search(r"is_chief|write_filepath|task_type", source):
        return _probe.FIXED
    return _probe.PRESENT if "self.model.save" in source else _probe.UNKNOWN


# -- model.save / model.save_weights / tf.saved_model.save / Checkpoint ---------------
def _patch_model() -> None:
    model = _model_class()
    save, save_weights = (_patch.original(model, "save"),
                          _patch.original(model, "save_weights"))

    @functools.wraps(save)
    def patched_save(self, filepath, overwrite=True, zipped=None, **kwargs):
        path = _path_or_none(filepath)
        if path is None or (not overwrite and os.path.exists(path)):
            return save(self, filepath, overwrite, zipped, **kwargs)
        return _writers().write(
            path, lambda target: save(self, target, True, zipped, **kwargs))

    @functools.wraps(save_weights)
    def patched_save_weights(self, filepath, overwrite=True, max_shard_size=None):
        path = _path_or_none(filepath)
        if path is None or (not overwrite and os.path.exists(path)):
            return save_weights(self, filepath, overwrite, max_shard_size)
        return _writers().write(
            path, lambda target: save_weights(self, target, True, max_shard_size),
            in_place=max_shard_size is not None)  # shards: several files

    _patch.patch(model, "save", patched_save, fix=NAME)
    _patch.patch(model, "save_weights", patched_save_weights, fix=NAME)


def _map_localhost_io_device(kwargs) -> None:
    """`experimental_io_device='/job:localhost'` -> this worker's own job.

    The save_and_load tutorial saves and loads "on localhost", a job that exists only
    while no cluster is configured; in a worker it is an unknown device. The intent -
    do the I/O on this process's host - is this worker's own task.
    """
    options = kwargs.get("options")
    device = getattr(options, "experimental_io_device", None)
    if not device or not _writers().active() or not device.startswith("/job:localhost"):
        return
    import copy

    from keras_dist import _runtime

    cluster = _runtime.cluster()
    own = f"/job:{cluster.task_type}/replica:0/task:{cluster.task_index}"
    options = copy.copy(options)
    options.experimental_io_device = re.sub(
        r"^/job:localhost(/replica:\d+)?(/task:\d+)?", own, device)
    kwargs["options"] = options


def _patch_tensorflow() -> None:
    save_module, load_module = _saved_model_modules()
    saved_model_save = _patch.original(save_module, "save")
    saved_model_load = _patch.original(load_module, "load")

    @functools.wraps(saved_model_save)
    def patched_saved_model_save(obj, export_dir, *args, **kwargs):
        _map_localhost_io_device(kwargs)
        path = _path_or_none(export_dir)
        if path is None:
            return saved_model_save(obj, export_dir, *args, **kwargs)
        return _writers().write(path, lambda target: saved_model_save(obj, target, *args,
                                                                     **kwargs))

    checkpoint = _checkpoint_class()
    write = _patch.original(checkpoint, "_write")

    @functools.wraps(write)
    def patched_write(self, file_prefix, options=None):
        path = _path_or_none(file_prefix)
        if path is None or (options is not None
                            and options.experimental_enable_async_checkpoint):
            return write(self, file_prefix, options)
        # TensorFlow's saver writes shards aside and the index last; the chief writes
        # the prefix itself so `save`'s "checkpoint" state file names the real path.
        return _writers().write(path, lambda target: write(self, target, options),
                              in_place=True, returns_path=True)

    @functools.wraps(saved_model_load)
    def patched_saved_model_load(export_dir, *args, **kwargs):
        _map_localhost_io_device(kwargs)
        return saved_model_load(export_dir, *args, **kwargs)

    _patch_function(save_module, "save", patched_saved_model_save)
    _patch_function(load_module, "load", patched_saved_model_load)
    _patch.patch(checkpoint, "_write", patched_write, fix=NAME)


# -- directories and callbacks ------------------------------------------------------
def _patch_makedirs() -> None:
    file_utils = _file_utils()
    makedirs = _patch.original(file_utils, "makedirs")

    @functools.wraps(makedirs)
    def patched_makedirs(path):
        # Keras checks `exists` then creates: two workers both pass the check.
        if _writers().active() and not file_utils.is_remote_path(path):
            return os.makedirs(path, exist_ok=True)
        return makedirs(path)

    _patch.patch(file_utils, "makedirs", patched_makedirs, fix=NAME)


def _patch_backup_and_restore() -> None:
    import keras

    cls = keras.callbacks.BackupAndRestore
    save_model, train_end = (_patch.original(cls, "_save_model"),
                             _patch.original(cls, "on_train_end"))

    @functools.wraps(save_model)
    def patched_save_model(self):
        def save_to(target):
            if target == self.backup_dir:
                return save_model(self)
            # Other workers: the weights only (the save may run collectives).
            os.makedirs(target, exist_ok=True)
            return self.model.save_weights(os.path.join(target, "latest.weights.h5"))

        return _writers().write(self.backup_dir, save_to, in_place=True)

    @functools.wraps(train_end)
    def patched_on_train_end(self, logs=None):
        if _writers().active() and not _is_chief():
            return None  # the chief deletes the shared backup
        return train_end(self, logs)

    _patch.patch(cls, "_save_model", patched_save_model, fix=NAME)
    _patch.patch(cls, "on_train_end", patched_on_train_end, fix=NAME)


def _redirect_callback(cls, attribute: str, begin_hook: str, kind: str) -> None:
    """Non-chief workers write `cls`'s `attribute` path under a private directory."""
    begin, end = _patch.original(cls, begin_hook), _patch.original(cls, "on_train_end")

    @functools.wraps(begin)
    def patched_begin(self, *args, **kwargs):
        real = getattr(self, attribute)
        if not _writers().active() or _is_chief() or _writers().is_private(str(real)):
            return begin(self, *args, **kwargs)
        private = self.__dict__.get("_keras_dist_private") or _writers().PrivateOutput(kind)
        self._keras_dist_private = private
        setattr(self, attribute, private.path_for(str(real)))
        try:
            return begin(self, *args, **kwargs)
        finally:
            setattr(self, attribute, real)

    @functools.wraps(end)
    def patched_end(self, logs=None):
        try:
            return end(self, logs)
        finally:
            private = self.__dict__.pop("_keras_dist_private", None)
            if private is not None:
                private.remove()

    _patch.patch(cls, begin_hook, patched_begin, fix=NAME)
    _patch.patch(cls, "on_train_end", patched_end, fix=NAME)


def apply() -> None:
    import keras

    _patch_model()
    _patch_tensorflow()
    _patch_makedirs()
    _patch_backup_and_restore()
    # TensorBoard fixes its writers' directory in set_model; CSVLogger opens its file
    # in on_train_begin.
    _redirect_callback(keras.callbacks.TensorBoard, "log_dir", "set_model", "tensorboard")
    _redirect_callback(keras.callbacks.CSVLogger, "filename", "on_train_begin", "csv")


FIX = Fix(
    name=NAME,
    upstream="tensorflow/tensorflow#31070, tensorflow/tensorflow#38635",
    summary="Under a multi-worker keras_dist.strategy(), stock writers called by every "
    "worker with one path: the chief writes it atomically, the others write removed "
    "temporaries, and all return once the chief's file is complete.",
    symbols=("keras.ModelCheckpoint._save_model", "keras.BackupAndRestore._save_model",
             "keras.file_utils.makedirs", "keras.TensorBoard._log_write_dir",
             "tf.Checkpoint._write", "tf.python.saved_model.save",
             "tf.python.saved_model.load", "tf.context.set_config_key_value",
             "tf.context.get_config_key_value"),
    probe=probe,
    apply=apply,
)
