"""Probes: does this Keras/TensorFlow still have a bug keras_dist works around?

A probe answers one of three verdicts. It reads upstream's own code (the original, also
when keras_dist's fix is installed) or runs a small behavioural check; it never looks at
version numbers, so a fix keeps applying on a newer Keras that still has the bug and
stops applying on one that fixed it.
"""

from __future__ import annotations

import inspect
import re
import textwrap

PRESENT = "present"  # the bug is there: apply the fix
FIXED = "fixed"  # upstream no longer has it: leave upstream alone
UNKNOWN = "unknown"  # cannot tell: apply the fix (it is safe either way) and warn once


def source_of(function) -> str | None:
    """The source of `function` with comments and blank lines dropped, or None."""
    if function is None:
        return None
    function = inspect.unwrap(function)
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    lines = [line.split("#", 1)[0].rstrip() for line in source.splitlines()]
    return "\n".join(line for line in lines if line.strip())


def verdict_from_source(function, bug_pattern: str, *, required: str | None = None) -> str:
    """PRESENT if `bug_pattern` (a regex) occurs in `function`'s code, else FIXED.

    UNKNOWN when the code cannot be read, or when `required` (a regex naming the code
    path the bug lives in) is missing too: then upstream restructured the code and a
    text check cannot decide.
    """
    source = source_of(function)
    if source is None:
        return UNKNOWN
    flat = re.sub(r"\s+", " ", source)
    if re.search(bug_pattern, flat):
        return PRESENT
    if required is not None and not re.search(required, flat):
        return UNKNOWN
    return FIXED
