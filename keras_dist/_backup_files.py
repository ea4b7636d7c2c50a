"""Old import path of `keras_dist.checkpointing.files` (kept working)."""

from keras_dist.checkpointing.files import (  # noqa: F401
    FORMAT,
    METADATA_NAME,
    Backup,
    BackupError,
    delete_backup,
    read_backup,
    sha256_of,
    temporary_name,
    write_backup,
)
