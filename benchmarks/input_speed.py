"""input_speed: the input iterator alone, `distribute_dataset` vs the seed's pipeline.

No model: each worker pulls batches from the iterator and nothing else, so the figure is
what the input can feed per second, the ceiling it puts on a step. Two arrays (60,000 x
784 float32, MNIST's shape; 1,000,000 x 64), each on 1 worker (TensorFlow's default
strategy) and on 2 launched workers (`MultiWorkerMirroredStrategy`), global batch 128:

* **plain**: the seed's `from_tensor_slices().shuffle(n).batch().repeat()` handed to
  `strategy.experimental_distribute_dataset` (a full shuffle, the only one whose order
  is as random as the global order's; on 2 workers tf.data shards it by data, so each
  worker reads everything and keeps its half of each batch);
* **keras_dist**: `distribute_dataset((x, y), 64 or 128, repeat=True)`: the global order
  (`keras_dist/data/order.py`), each worker gathering only its part of each global batch.

Both iterators are built, warmed up, then timed in alternating chunks (ABAB...); examples/s
is global examples per second (the job's step rate x the global batch), the median over
chunks, the slower worker's. Memory: each worker's resident set is sampled while it
builds, starts and reads each pipeline, one pipeline per fresh process (one worker; a
worker of 2 holds the same, but for the order's indices); `rss_mb` is the rise over the
arrays already in memory.
keras_dist's order costs O(n) int64 per worker per epoch (the epoch's permutation, then
this worker's positions in it): `order_bytes_per_worker` is that figure, computed.

`structure` records the op chain of keras_dist's one-worker pipeline, source first; the
smoke test asserts that without a `map_fn` no function runs once per example
(the regression of issue 36: a gather per example cost 10x the seed's pipeline per step).
"""

from __future__ import annotations

import math

from benchmarks import common

NAME = "input_speed"
PIPELINES = ("plain", "keras_dist")
GLOBAL_BATCH = 128


def settings(mode: str) -> dict:
    return dict(
        shapes=common.pick(mode, smoke=[[2048, 784], [4096, 64]],
                           quick=[[60_000, 784], [1_000_000, 64]],
                           full=[[60_000, 784], [1_000_000, 64]]),
        workers=[1, 2],
        warmup_steps=common.pick(mode, smoke=2, quick=20, full=50),
        steps=common.pick(mode, smoke=4, quick=200, full=500),
        rounds=common.pick(mode, smoke=1, quick=3, full=5),
    )


def structure(dataset) -> list[str]:
    """The dataset op types `dataset`'s examples pass through, source first.

    A `flat_map` is replaced by the chain of the dataset its function returns: the
    examples come from there (keras_dist's epoch pipeline; the outer input only says
    which epoch).
    """
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph(
        external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN).numpy())
    functions = {function.signature.name: function for function in graph.library.function}

    def chain(nodes: dict, name: str) -> list[str]:
        """Output first, following each op's input dataset."""
        found = []
        while name in nodes:
            node = nodes[name]
            if node.op == "FlatMapDataset":
                inner = functions[node.attr["f"].func.name]
                output = inner.ret[inner.signature.output_arg[0].name]
                return found + chain({n.name: n for n in inner.node_def},
                                     output.split(":")[0])
            if "Dataset" in node.op:
                found.append(node.op)
            inputs = [value.split(":")[0] for value in node.input
                      if not value.startswith("^")]
            datasets = [value for value in inputs if value in nodes and (
                "Dataset" in nodes[value].op or nodes[value].op == "Identity")]
            if not datasets:
                break
            name = datasets[0]
        return found

    nodes = {node.name: node for node in graph.node}
    output = next(node.input[0] for node in graph.node if node.op == "_Retval")
    return list(reversed(chain(nodes, output.split(":")[0])))


def per_example_functions(chain: list[str]) -> int:
    """How many map functions of the chain run once per example rather than per batch."""
    count, batched = 0, False
    for op in chain:
        if op.startswith(("BatchDataset", "PaddedBatchDataset")):
            batched = True
        elif op in ("UnbatchDataset", "TensorSliceDataset"):
            batched = False
        elif "MapDataset" in op and "Flat" not in op and not batched:
            count += 1
    return count


def _pipelines(strategy, x, y):
    """Builders of both pipelines: name -> () -> what `iter` takes."""
    import tensorflow as tf

    import keras_dist

    per_replica = GLOBAL_BATCH // strategy.num_replicas_in_sync

    def plain():
        return strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0)
            .batch(GLOBAL_BATCH).repeat())

    def ours():
        return keras_dist.distribute_dataset((x, y), per_replica, repeat=True)

    return {"plain": plain, "keras_dist": ours}


def measure(config: dict, shape: list) -> dict:
    """One worker: build both pipelines, time them in alternating chunks."""
    import time

    import numpy as np
    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    x, y = common.synthetic_classification(*shape)
    builders = _pipelines(strategy, x, y)
    data = builders["keras_dist"]()
    # On one worker the strategy wraps the pipeline it was given whole.
    original = getattr(data, "_original_dataset", data)
    chain = structure(original) if isinstance(original, tf.data.Dataset) else None
    iterators = {"keras_dist": iter(data), "plain": iter(builders["plain"]())}
    for iterator in iterators.values():
        for _ in range(config["warmup_steps"]):
            next(iterator)
    chunks = {name: [] for name in PIPELINES}
    for round_index in range(config["rounds"]):
        for name in (PIPELINES if round_index % 2 == 0 else PIPELINES[::-1]):
            keras_dist.barrier()  # the workers time the same chunk together
            start = time.perf_counter()
            for _ in range(config["steps"]):
                next(iterators[name])
            chunks[name].append(time.perf_counter() - start)
    workers = keras_dist.num_workers()
    return {"chunks": chunks, "structure": chain, "workers": workers,
            "array_bytes": int(x.nbytes + y.nbytes),
            # The epoch's permutation, this worker's positions, its indices (int64).
            "order_bytes": int(np.dtype(np.int64).itemsize * (
                shape[0] + 2 * -(-shape[0] // workers)))}


def memory(config: dict, shape: list, pipeline: str) -> int:
    """One fresh process, one pipeline: the rise of the resident set over the arrays
    while it is built, started and read for its warm-up steps (bytes)."""
    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    # The runtime's own first-use allocations are neither pipeline's.
    next(iter(tf.data.Dataset.range(2).map(lambda i: i + 1).batch(2)))
    x, y = common.synthetic_classification(*shape)
    with common.RssSampler() as sampled:
        iterator = iter(_pipelines(strategy, x, y)[pipeline]())
        for _ in range(config["warmup_steps"]):
            next(iterator)
    return sampled.peak - sampled.start


def _summarize_case(results: list, config: dict, shape: list) -> dict:
    steps = config["steps"]
    out = {}
    for name in PIPELINES:
        seconds = [max(result["chunks"][name][i] for result in results)
                   for i in range(config["rounds"])]
        out[name] = {
            "examples_per_s": GLOBAL_BATCH * steps / common.median(seconds),
        }
    return {
        "examples": shape[0], "features": shape[1], "workers": results[0]["workers"],
        "ratio": common.ratio(out["keras_dist"]["examples_per_s"],
                              out["plain"]["examples_per_s"]),
        "array_mb": results[0]["array_bytes"] / 2**20,
        "order_bytes_per_worker": results[0]["order_bytes"],
        "pipelines": out,
        "structure": results[0]["structure"],
    }


def run(mode: str) -> dict:
    config = settings(mode)
    cases = []
    for shape in config["shapes"]:
        for workers in config["workers"]:
            kwargs = {"config": config, "shape": shape}
            results = (common.run_workers(measure, workers, kwargs=kwargs) if workers > 1
                       else [common.run_isolated(measure, kwargs=kwargs)])
            case = _summarize_case(results, config, shape)
            if workers == 1:  # each worker holds what one worker holds, order aside
                for name in PIPELINES:
                    case["pipelines"][name]["rss_mb"] = common.run_isolated(
                        memory, kwargs={**kwargs, "pipeline": name}) / 2**20
            cases.append(case)
    one_worker = next(case for case in cases if case["structure"])
    return {
        "cases": cases,
        # The worst case: the input must keep up with the seed's on every shape and count.
        "ratio_min": min(case["ratio"] for case in cases),
        "structure": one_worker["structure"],
        "per_example_functions": per_example_functions(one_worker["structure"]),
        "config": config,
    }


def report(result: dict) -> None:
    rows = []
    for case in result["cases"]:
        plain, ours = case["pipelines"]["plain"], case["pipelines"]["keras_dist"]
        rows.append((f"{case['examples']:,} x {case['features']}", case["workers"],
                     plain["examples_per_s"], ours["examples_per_s"], case["ratio"],
                     plain.get("rss_mb", math.nan), ours.get("rss_mb", math.nan),
                     case["order_bytes_per_worker"] / 2**20, case["array_mb"]))
    common.print_table(
        f"input_speed: the iterator alone, global batch {GLOBAL_BATCH}, median of "
        f"{result['config']['rounds']} chunks x {result['config']['steps']} steps",
        ["arrays", "workers", "plain ex/s", "keras_dist ex/s", "ratio", "plain +MB",
         "keras_dist +MB", "order MB/worker", "arrays MB"], rows)
    print("keras_dist's one-worker pipeline: " + " -> ".join(result["structure"]) +
          f" ({result['per_example_functions']} function(s) per example before the batch)",
          flush=True)
