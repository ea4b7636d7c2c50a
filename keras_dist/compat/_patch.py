"""Recorded monkey-patches: every attribute keras_dist replaces upstream can be put back.

`patch(owner, name, replacement, fix=...)` remembers the original the first time an
attribute is replaced; `original(owner, name)` answers what upstream had (probes read
upstream's code, never keras_dist's wrapper); `revert(fix=None)` restores them.
"""

from __future__ import annotations

import threading

_lock = threading.RLock()
# (id(owner), name) -> (owner, name, original, had_own_attribute, fix)
_patched: dict[tuple[int, str], tuple[object, str, object, bool, str]] = {}
_MISSING = object()


def patch(owner, name: str, replacement, *, fix: str) -> None:
    """Sets `owner.name = replacement`, remembering upstream's value for `revert`."""
    with _lock:
        key = (id(owner), name)
        if key not in _patched:
            own = name in getattr(owner, "__dict__", {})
            original = owner.__dict__[name] if own else getattr(owner, name, _MISSING)
            _patched[key] = (owner, name, original, own, fix)
        replacement._keras_dist_fix = fix
        setattr(owner, name, replacement)


def original(owner, name: str):
    """Upstream's `owner.name`, also while keras_dist's replacement is installed."""
    with _lock:
        entry = _patched.get((id(owner), name))
    if entry is None:
        return getattr(owner, name, None)
    value = entry[2]
    return None if value is _MISSING else value


def revert(fix: str | None = None) -> list[str]:
    """Restores the attributes patched for `fix` (all fixes if None); returns their names."""
    restored = []
    with _lock:
        for key, (owner, name, value, own, fix_name) in list(_patched.items()):
            if fix is not None and fix_name != fix:
                continue
            if own:
                setattr(owner, name, value)
            elif value is _MISSING or name in getattr(owner, "__dict__", {}):
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            del _patched[key]
            restored.append(f"{getattr(owner, '__name__', owner)}.{name}")
    return restored
