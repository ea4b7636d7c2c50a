"""The all-reduce benchmark behind `keras-dist bench allreduce` (and benchmarks/communication.py).

On N launched local workers (one `MultiWorkerMirroredStrategy` replica each on CPU) it
times `ReplicaContext.all_reduce(SUM)` inside `strategy.run` in a `tf.function`, for
tensor sizes from 1 KB to 64 MB, three ways:

* `plain_fp32`: what plain tf.distribute (and stock Keras) does, `all_reduce(SUM, [x])`
  with no options;
* `keras_dist_fp32`: keras_dist's gradient path, a list all-reduce with the
  `CommunicationOptions` keras_dist builds (`bytes_per_pack`, implementation);
* `keras_dist_bf16`: keras_dist's `compression="bf16"` path: cast to bfloat16,
  all-reduce half the bytes, cast back (the casts are timed too).

Figures follow nccl-tests: `algbw = bytes / time` and `busbw = algbw * 2(n-1)/n` (the
traffic each link carries in a ring, comparable across worker counts), with `bytes`
the size of the tensor actually all-reduced (half for bf16). `speedup` is the time of
plain fp32 over the path's time for the same number of float32 values.

With `--link-rate 10gbit` (`linked_sweep(..., link=planning.Link(...))`) the workers run
behind the link simulator (`keras_dist.planning.run_in_link`: a private network namespace
whose loopback is rate-limited with tc); the raw TCP rate of the link is measured first and
"achieved vs set" is printed after the table.

Each measurement chains `inner` all-reduces in one traced function (so Python dispatch
is amortised) and calls it `outer` times; both counts depend only on the size, so every
worker issues the same collectives in the same order.
"""

from __future__ import annotations

import json
import math
import time
from typing import Sequence

__all__ = ["DEFAULT_SIZES", "PATHS", "allreduce_main", "bus_factor", "linked_sweep", "sweep"]

DEFAULT_SIZES = tuple(1 << shift for shift in range(10, 27, 2))  # 1 KB .. 64 MB, x4
PATHS = ("plain_fp32", "keras_dist_fp32", "keras_dist_bf16")
_BUDGET_BYTES = 256 << 20  # bytes all-reduced per measurement, before the caps below
_MIN_ITERATIONS, _MAX_ITERATIONS, _MAX_INNER = 3, 200, 20


def bus_factor(num_replicas: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor, 2(n-1)/n."""
    return 2 * (num_replicas - 1) / num_replicas if num_replicas > 1 else 0.0


def iterations(size_bytes: int, budget_bytes: int = _BUDGET_BYTES) -> tuple[int, int]:
    """(inner, outer) all-reduce counts for a tensor of `size_bytes`; size-only."""
    total = max(_MIN_ITERATIONS, min(_MAX_ITERATIONS, budget_bytes // max(size_bytes, 1)))
    inner = min(total, _MAX_INNER)
    return inner, max(1, math.ceil(total / inner))


def _options(implementation: str, bytes_per_pack: int):
    from keras_dist.strategies.communication import communication_options

    return communication_options(implementation, bytes_per_pack)


def _step_function(strategy, path: str, inner: int, options):
    """A tf.function running `inner` chained all-reduces of one list of tensors."""
    import tensorflow as tf

    from keras_dist.aggregation import ops as gops

    def replica_fn(*tensors):
        context = tf.distribute.get_replica_context()
        # Placed on the replica's device: a function input has no device, and
        # tf.distribute takes the all-reduce's destination from it.
        values = [tf.identity(tensor) for tensor in tensors]
        for _ in range(inner):
            if path == "plain_fp32":
                # What Keras does with the gradient list: one call, no options.
                values = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
            elif path == "keras_dist_fp32":
                values = context.all_reduce(tf.distribute.ReduceOp.SUM, values,
                                            options=options)
            elif path == "keras_dist_bf16":
                dtypes = gops.dtypes_of(values)
                reduced = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                             gops.compress(values, "bf16"), options=options)
                values = gops.decompress(reduced, dtypes)
            else:
                raise ValueError(f"Unknown all-reduce path {path!r}; expected one of {PATHS}")
        # A scalar out: fetching it waits for the collectives without copying tensors.
        return tf.add_n([tf.reduce_sum(value[:1]) for value in values])

    @tf.function
    def step(*tensors):
        return strategy.run(replica_fn, args=tensors)

    return step


def time_all_reduce(strategy, shapes: Sequence[int], path: str, *, implementation="auto",
                    bytes_per_pack: int = 0, budget_bytes: int = _BUDGET_BYTES,
                    with_cpu: bool = False):
    """Seconds per all-reduce of float32 tensors with `shapes` elements along `path`.

    With `with_cpu=True`, returns `(wall_s, cpu_s)`: `cpu_s` is this process's CPU time
    (all its threads: TensorFlow's executor, the collective's and gRPC's) per
    all-reduce, the part that competes with computation on a busy machine.
    """
    import tensorflow as tf

    size = 4 * sum(shapes)
    inner, outer = iterations(size, budget_bytes)
    tensors = [tf.zeros([count], tf.float32) for count in shapes]
    step = _step_function(strategy, path, inner, _options(implementation, bytes_per_pack))
    _fetch(strategy, step(*tensors))  # trace and warm up
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(outer):
        result = step(*tensors)
    _fetch(strategy, result)
    count = inner * outer
    wall = (time.perf_counter() - start) / count
    if with_cpu:
        return wall, (time.process_time() - cpu_start) / count
    return wall


def _fetch(strategy, result):
    return [float(v) for v in strategy.experimental_local_results(result)]


def sweep(strategy, sizes: Sequence[int] = DEFAULT_SIZES, paths: Sequence[str] = PATHS, *,
          implementation: str = "auto", budget_bytes: int = _BUDGET_BYTES) -> list[dict]:
    """All-reduce time, algbw and busbw for each size (bytes of float32) and path."""
    replicas = strategy.num_replicas_in_sync
    rows = []
    for size in sizes:
        elements = max(1, int(size) // 4)
        for path in paths:
            seconds = time_all_reduce(strategy, [elements], path,
                                      implementation=implementation,
                                      budget_bytes=budget_bytes)
            wire_bytes = elements * (2 if path.endswith("bf16") else 4)
            algbw = wire_bytes / seconds
            rows.append({"size_bytes": 4 * elements, "path": path, "wire_bytes": wire_bytes,
                         "time_us": 1e6 * seconds, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * bus_factor(replicas) / 1e9})
    plain = {row["size_bytes"]: row["time_us"] for row in rows if row["path"] == "plain_fp32"}
    for row in rows:
        if row["size_bytes"] in plain:
            row["speedup"] = plain[row["size_bytes"]] / row["time_us"]
    return rows


def allreduce_worker(sizes: Sequence[int], paths: Sequence[str] = PATHS,
                     budget_bytes: int = _BUDGET_BYTES, implementation: str = "auto") -> dict:
    """One worker's part: the keras_dist strategy, then the sweep."""
    import tensorflow as tf

    import keras_dist

    # Each measurement traces a new function on purpose; TF's retracing warning is noise.
    tf.get_logger().setLevel("ERROR")
    strategy = keras_dist.strategy(implementation=implementation)
    rows = sweep(strategy, sizes, paths, implementation=implementation,
                 budget_bytes=budget_bytes)
    return {"replicas": strategy.num_replicas_in_sync, "rows": rows}


def summarize(worker_results: Sequence[dict]) -> dict:
    """Worker 0's rows, each time replaced by the slowest worker's (a collective ends last)."""
    rows = [dict(row) for row in worker_results[0]["rows"]]
    replicas = worker_results[0]["replicas"]
    for index, row in enumerate(rows):
        seconds = max(result["rows"][index]["time_us"] for result in worker_results) / 1e6
        row["time_us"] = 1e6 * seconds
        row["algbw_GBps"] = row["wire_bytes"] / seconds / 1e9
        row["busbw_GBps"] = row["algbw_GBps"] * bus_factor(replicas)
    plain = {row["size_bytes"]: row["time_us"] for row in rows if row["path"] == "plain_fp32"}
    for row in rows:
        if row["size_bytes"] in plain:
            row["speedup"] = plain[row["size_bytes"]] / row["time_us"]
    return {"replicas": replicas, "bus_factor": bus_factor(replicas), "rows": rows}


def _sweep_on_workers(workers: int, sizes: Sequence[int], paths: Sequence[str],
                      budget_bytes: int, measure_raw_link: bool) -> dict:
    from keras_dist.testing import run_on_workers

    link = None
    if measure_raw_link:
        from keras_dist.planning import measure_link

        link = measure_link(workers, 32 << 20, repeats=2)
    results = run_on_workers(allreduce_worker, workers,
                             kwargs={"sizes": list(sizes), "paths": list(paths),
                                     "budget_bytes": budget_bytes}, timeout=1800)
    return {"results": results, "raw_link": link}


def linked_sweep(workers: int, sizes: Sequence[int], link=None,
                 paths: Sequence[str] = PATHS, budget_bytes: int = _BUDGET_BYTES) -> dict:
    """The sweep on `workers` local workers, behind `link` (a `planning.Link`) if given.

    Behind a link, the raw TCP rate of the link (`planning.measure_link`) is measured
    first, and the summary gains `link` (set and achieved rates, per worker).
    """
    kwargs = {"workers": workers, "sizes": list(sizes), "paths": list(paths),
              "budget_bytes": budget_bytes, "measure_raw_link": link is not None}
    if link is None:
        outcome = _sweep_on_workers(**kwargs)
    else:
        from keras_dist.planning import run_in_link

        outcome = run_in_link(_sweep_on_workers, link, kwargs=kwargs, timeout=3600)
    summary = summarize(outcome["results"])
    summary["workers"] = workers
    if link is not None:
        fp32 = [row for row in summary["rows"] if row["path"] == "plain_fp32"] or \
            summary["rows"]
        largest = max(fp32, key=lambda row: row["size_bytes"])
        summary["link"] = {
            "set_per_worker_bps": link.rate_bps,
            "set_qdisc_bps": link.qdisc_rate_bps,
            "latency_s": link.latency_s,
            "raw_tcp_per_worker_bps": outcome["raw_link"]["per_worker_bps"],
            "allreduce_busbw_largest_bps": 8e9 * largest["busbw_GBps"],
            "largest_size_bytes": largest["size_bytes"],
        }
    return summary


def link_lines(summary: dict) -> list[str]:
    """'Achieved vs set' for a sweep behind a simulated link (empty without one)."""
    link = summary.get("link")
    if not link:
        return []
    from keras_dist.planning import format_rate

    set_rate = link["set_per_worker_bps"]

    def share(rate):
        return f" ({rate / set_rate:.0%} of set)" if set_rate else ""

    return [
        f"\nsimulated link: set {format_rate(set_rate)} per worker"
        + (f" (loopback tbf {format_rate(link['set_qdisc_bps'])}: one qdisc carries all "
           f"{summary['workers']} workers' traffic)" if set_rate else "")
        + (f", +{link['latency_s'] * 1e6:g} us" if link["latency_s"] else ""),
        f"  achieved, raw TCP ring per worker: "
        f"{format_rate(link['raw_tcp_per_worker_bps'])}{share(link['raw_tcp_per_worker_bps'])}",
        f"  achieved, all-reduce busbw at {format_size(link['largest_size_bytes'])}: "
        f"{format_rate(link['allreduce_busbw_largest_bps'])}"
        f"{share(link['allreduce_busbw_largest_bps'])}",
    ]


def format_size(size: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def table_lines(summary: dict) -> list[str]:
    """The sweep as a text table: one line per size, the paths side by side."""
    by_size: dict[int, dict] = {}
    for row in summary["rows"]:
        by_size.setdefault(row["size_bytes"], {})[row["path"]] = row
    paths = [p for p in PATHS if any(p in cols for cols in by_size.values())]
    header = f"{'size':>8}"
    for path in paths:
        header += f" | {path + ' us':>20} {'busbw MB/s':>10} {'vs plain':>8}"
    lines = [header, "-" * len(header)]
    for size, columns in by_size.items():
        line = f"{format_size(size):>8}"
        for path in paths:
            row = columns.get(path)
            if row is None:
                line += f" | {'':>20} {'':>10} {'':>8}"
                continue
            line += (f" | {row['time_us']:>20.1f} {1000 * row['busbw_GBps']:>10.1f} "
                     f"{row.get('speedup', math.nan):>8.2f}")
        lines.append(line)
    return lines


def allreduce_main(args) -> int:
    """`keras-dist bench allreduce`: runs the sweep on `args.workers` local workers.

    Args:
        args: An argparse namespace with `workers` (int), `sizes` (list of byte counts,
            or None for 1 KB..64 MB), `output` (JSON path or None) and optionally
            `link_rate` / `link_latency` ("10gbit" / "50us": run behind the link
            simulator, `keras_dist.planning.Link`).

    Returns:
        The exit code (0).
    """
    sizes = list(args.sizes or DEFAULT_SIZES)
    workers = int(args.workers)
    link = None
    if getattr(args, "link_rate", None) or getattr(args, "link_latency", None):
        from keras_dist.planning import Link, check_support

        link = Link.parse(args.link_rate, args.link_latency, workers)
        check_support(link)  # a clear error before anything starts
    print(f"keras-dist bench allreduce: {workers} local worker(s), "
          f"{len(sizes)} size(s), paths {', '.join(PATHS)}"
          + (f", behind a simulated link of {link.describe()}" if link else ""), flush=True)
    summary = linked_sweep(workers, sizes, link)
    print(f"\nall-reduce on {workers} worker(s) x {summary['replicas'] // workers} replica(s);"
          f" busbw = algbw x {summary['bus_factor']:.2f}; 'vs plain' = plain fp32 time / "
          "this path's time")
    for line in table_lines(summary):
        print(line)
    for line in link_lines(summary):
        print(line)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump(summary, file, indent=2)
        print(f"wrote {args.output}")
    return 0
