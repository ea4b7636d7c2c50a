"""keras_dist.barrier(): workers wait for each other; a missing worker is named on timeout."""

import pytest

import keras_dist
from keras_dist.testing import run_on_workers


def _late_worker(sleep_seconds, timeout_seconds):
    import time

    import keras_dist
    from keras_dist.barriers import BarrierTimeoutError

    keras_dist.strategy()
    keras_dist.barrier("start")  # both arrive
    if keras_dist.worker_index() == 1:
        time.sleep(sleep_seconds)  # misses the next barrier's deadline
        return {"late": True}
    started = time.monotonic()
    try:
        keras_dist.barrier("after-sleep", timeout_seconds=timeout_seconds)
    except BarrierTimeoutError as error:
        return {"message": str(error), "missing": error.missing,
                "waited": time.monotonic() - started,
                "is_timeout": isinstance(error, TimeoutError)}
    return {"message": None}


@pytest.mark.multiworker
@pytest.mark.slow
def test_barrier_timeout_names_the_missing_worker():
    chief, late = run_on_workers(_late_worker, num_workers=2, args=(6, 2), timeout=90)
    assert late == {"late": True}
    assert chief["is_timeout"] and chief["waited"] < 5, chief
    assert [rank for rank, _ in chief["missing"]] == [1], chief
    address = chief["missing"][0][1]
    assert address.startswith("127.0.0.1:") or address.startswith("localhost:"), chief
    assert "worker 1 (" + address + ")" in chief["message"], chief["message"]
    assert "'after-sleep'" in chief["message"], chief["message"]


def test_barrier_is_a_no_op_in_one_process():
    keras_dist.barrier()
    keras_dist.barrier("named", timeout_seconds=0.01)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"name": ""}, "Argument `name` must be None or a non-empty string"),
    ({"name": "a b"}, "Received: name='a b'"),
    ({"timeout_seconds": 0}, "Argument `timeout_seconds` must be a positive number"),
    ({"timeout_seconds": "5"}, "Received: timeout_seconds='5'"),
])
def test_barrier_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        keras_dist.barrier(**kwargs)
