

def start_workers_first(request, used_by: str, fn, timeout: float):
    """`fn` on 2 workers in the background, when a selected test uses fixture `used_by`.

    For a module that compares a 2-worker run with a multi-device subprocess: the workers
    start first, so the processes share the machine instead of taking turns. Returns
    `keras_dist.testing.Running` (`.result()` waits), or None when no selected test needs
    the workers.
    """
    from keras_dist.testing import start_on_workers

    if not any(used_by in item.fixturenames for item in request.session.items):
        return None
    return start_on_workers(fn, num_workers=2, timeout=timeout)
