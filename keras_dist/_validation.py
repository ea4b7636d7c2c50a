"""The shared argument checks: one integer rule, one number rule, one message shape.

Every public keras_dist function validates its arguments through these, so the same bad
value gets the same answer everywhere: ``Argument `name` must be <expected>. Received:
name=<value>`` (Keras' shape), optionally followed by what to do.

Integers are `numbers.Integral` (so numpy integers pass) but never `bool`; numbers are
`numbers.Real` but never `bool`, and never NaN.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def message(name: str, expected: str, value: Any, hint: str = "") -> str:
    """``Argument `name` must be <expected>. Received: name=<value!r>[ hint]``."""
    text = f"Argument `{name}` must be {expected}. Received: {name}={value!r}"
    return f"{text}. {hint}" if hint else text


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and not (isinstance(value, float) and math.isnan(value)))


def check_int(name: str, value: Any, minimum: int | None = None, *, hint: str = "",
              error: type[Exception] = ValueError) -> int:
    """`value` as an int, if it is an integer >= `minimum`; else `error` saying so."""
    if not is_int(value) or (minimum is not None and value < minimum):
        expected = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise error(message(name, expected, value, hint))
    return int(value)


def check_number(name: str, value: Any, *, minimum: float | None = None,
                 exclusive: bool = True, hint: str = "", unit: str = "",
                 error: type[Exception] = ValueError, or_none: bool = False) -> float:
    """`value` as a float, if it is a number above `minimum` (or at it, not exclusive)."""
    ok = is_number(value) and (
        minimum is None or (value > minimum if exclusive else value >= minimum))
    if not ok:
        bound = "" if minimum is None else f" {'>' if exclusive else '>='} {minimum:g}"
        expected = f"a number{bound}" + (f" ({unit})" if unit else "")
        expected += " or None" if or_none else ""
        raise error(message(name, expected, value, hint))
    return float(value)


def check_optional_number(name: str, value: Any, **kwargs) -> float | None:
    """None stays None; anything else must pass `check_number`."""
    if value is None:
        return None
    return check_number(name, value, or_none=True, **kwargs)


def check_bool(name: str, value: Any, *, error: type[Exception] = ValueError) -> bool:
    if not isinstance(value, bool):
        raise error(message(name, "True or False", value))
    return value


def check_choice(name: str, value: Any, choices) -> Any:
    if value not in tuple(choices):
        raise ValueError(message(name, f"one of {list(choices)}", value))
    return value
