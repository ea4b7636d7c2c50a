"""Slurm -> TF_CONFIG translation (filled in by the Slurm work; see cluster.py)."""

from __future__ import annotations

from typing import Mapping


def tf_config_from_slurm(environ: Mapping[str, str], error_type: type) -> dict | None:
    """Returns a TF_CONFIG-shaped mapping from Slurm variables, or None outside Slurm."""
    return None
