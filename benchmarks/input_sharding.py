"""input_sharding: how much of the dataset each of 2 workers reads and preprocesses.

The map_fn is expensive on purpose: a `tf.py_function` that counts its calls and sleeps
`map_cost_ms` per element (sleep, not arithmetic, so the cost does not depend on how
busy the machine's cores are). Two pipelines, on the same 2 launched workers:

* **seed**: `from_tensor_slices().shuffle().map().batch()` handed to
  `strategy.experimental_distribute_dataset`. tf.data's auto-sharding finds no files
  and falls back to sharding by data, so every worker reads and maps the whole
  dataset and keeps 1/2 of it;
* **keras_dist**: `distribute_dataset(arrays, map_fn=...)`, which shards at the source,
  so each worker reads and maps its half only.

Each pipeline is iterated for one epoch without a model (input throughput only);
`reads_per_worker_fraction` = map_fn calls on a worker / dataset size (mean over the
workers), `throughput_ratio` = keras_dist examples/s / seed examples/s.
"""

from __future__ import annotations

from benchmarks import common

NAME = "input_sharding"
PIPELINES = ("seed", "keras_dist")


def settings(mode: str) -> dict:
    return dict(
        examples=common.pick(mode, smoke=64, quick=1024, full=4096),
        features=16,
        per_replica_batch=16,
        map_cost_ms=common.pick(mode, smoke=1.0, quick=2.0, full=2.0),
        rounds=common.pick(mode, smoke=1, quick=1, full=3),
    )


def measure(config: dict) -> dict:
    """One worker: iterate each pipeline for an epoch; count map_fn calls and time it."""
    import threading
    import time

    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    x, y = common.synthetic_classification(config["examples"], config["features"])
    lock = threading.Lock()
    calls = [0]
    cost = config["map_cost_ms"] / 1000

    def work(values):
        with lock:
            calls[0] += 1
        time.sleep(cost)
        return values

    def map_fn(features, label):
        mapped = tf.py_function(work, [features], tf.float32)
        mapped.set_shape(features.shape)
        return mapped, label

    per_replica = config["per_replica_batch"]
    global_batch = per_replica * strategy.num_replicas_in_sync

    def seed_pipeline():
        dataset = (tf.data.Dataset.from_tensor_slices((x, y))
                   .shuffle(len(x), seed=0)
                   .map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
                   .batch(global_batch))
        return strategy.experimental_distribute_dataset(dataset)

    def keras_dist_pipeline():
        return keras_dist.distribute_dataset((x, y), per_replica, map_fn=map_fn)

    builders = {"seed": seed_pipeline, "keras_dist": keras_dist_pipeline}
    runs = {name: [] for name in PIPELINES}
    for round_index in range(config["rounds"]):
        order = PIPELINES if round_index % 2 == 0 else PIPELINES[::-1]
        for name in order:
            data = builders[name]()
            calls[0] = 0
            examples = 0
            start = time.perf_counter()
            for batch in data:
                features = batch[0]
                examples += sum(int(tf.shape(local)[0])
                                for local in strategy.experimental_local_results(features))
            seconds = time.perf_counter() - start
            runs[name].append({"map_calls": calls[0], "examples_seen": examples,
                               "seconds": seconds})
    return {"runs": runs, "examples": len(x), "workers": keras_dist.num_workers()}


def summarize(results: list, config: dict) -> dict:
    total = results[0]["examples"]
    out = {}
    for name in PIPELINES:
        fraction = common.median(
            [run["map_calls"] / total for result in results for run in result["runs"][name]])
        seconds = common.median([max(result["runs"][name][i]["seconds"] for result in results)
                                 for i in range(config["rounds"])])
        seen = sum(result["runs"][name][0]["examples_seen"] for result in results)
        out[name] = {"reads_fraction": fraction, "seconds": seconds,
                     "examples_per_s": total / seconds, "examples_seen_all_workers": seen}
    return {
        "reads_per_worker_fraction": out["keras_dist"]["reads_fraction"],
        "seed_reads_per_worker_fraction": out["seed"]["reads_fraction"],
        "throughput_ratio": common.ratio(out["keras_dist"]["examples_per_s"],
                                         out["seed"]["examples_per_s"]),
        "pipelines": out,
        "workers": results[0]["workers"],
        "config": config,
    }


def run(mode: str) -> dict:
    config = settings(mode)
    return summarize(common.run_workers(measure, 2, kwargs={"config": config}), config)


def report(result: dict) -> None:
    config = result["config"]
    rows = [(name, p["reads_fraction"], p["examples_per_s"], p["seconds"],
             p["examples_seen_all_workers"]) for name, p in result["pipelines"].items()]
    common.print_table(
        f"input_sharding: {config['examples']} examples, map_fn {config['map_cost_ms']} ms "
        f"per element, {result['workers']} workers",
        ["pipeline", "reads/worker", "examples/s", "epoch s", "examples trained"], rows,
    )
    print(f"throughput ratio keras_dist/seed = {result['throughput_ratio']:.2f}", flush=True)
