"""How a launched worker tells `keras-dist launch` that its group came up.

The launcher gives each worker a file path (`KERAS_DIST_UP_FILE`); the worker creates
the file once it met every peer (`keras_dist.startup.rendezvous`). A slot whose worker
fails again before any worker of its group came up is one whose host is gone: with
`min_workers` the launcher shrinks the group without it (`keras_dist.launching.local`).
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["UP_FILE_ENV", "report_up"]

# Set by `keras-dist launch` for each worker: the file to create once the group is up
# (every peer met), so the launcher can tell a slot that fails before its group forms
# (a host that is gone) from a failure during training (`min_workers`).
UP_FILE_ENV = "KERAS_DIST_UP_FILE"


def report_up(environ: Mapping[str, str] | None = None) -> None:
    """Tells the launcher (if any) that this worker met all its peers."""
    path = (os.environ if environ is None else environ).get(UP_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "w") as file:
            file.write(str(os.getpid()))
    except OSError:
        pass  # the launcher's directory is gone: it stopped caring
