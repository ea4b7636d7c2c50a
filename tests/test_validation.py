"""keras_dist._validation: one rule per kind of argument, one message shape."""

import numpy as np
import pytest

from keras_dist import _validation as v


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3)])
def test_integers_include_numpy_integers(value):
    assert v.check_int("steps", value, minimum=1) == 3


@pytest.mark.parametrize("value", [True, 2.0, "2", None, 0])
def test_non_integers_and_too_small_values_name_the_argument(value):
    with pytest.raises(ValueError, match=r"Argument `steps` must be an integer >= 1\. "
                                         r"Received: steps="):
        v.check_int("steps", value, minimum=1)


@pytest.mark.parametrize("value", [float("nan"), -1, 0, True, "1"])
def test_numbers_reject_nan_bool_and_out_of_range(value):
    with pytest.raises(ValueError, match=r"Argument `timeout` must be a number > 0"):
        v.check_number("timeout", value, minimum=0, unit="seconds")


def test_optional_number_and_hint():
    assert v.check_optional_number("timeout", None, minimum=0) is None
    with pytest.raises(ValueError, match=r"must be a number > 0 or None\. Received"):
        v.check_optional_number("timeout", -1, minimum=0)


def test_choice_and_bool():
    assert v.check_choice("mode", "row", ("row", "column")) == "row"
    with pytest.raises(ValueError, match=r"one of \['row', 'column'\]"):
        v.check_choice("mode", "diag", ("row", "column"))
    with pytest.raises(ValueError, match="True or False"):
        v.check_bool("shuffle", 1)
