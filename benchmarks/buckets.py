"""buckets: the all-reduce bucket size (`bytes_per_pack`) swept against model size and link.

On 2 launched workers (1 intra-op + 2 inter-op threads each, see `settings`), each
model below is trained once per bucket size with `GradientAggregation(bytes_per_pack=
size)` (0: one pack, TensorFlow's own default), in alternating timed chunks. The
gradients of a model are all-reduced in packs of about `size` bytes, in reverse layer
order, each pack issued as soon as its gradients exist, so a pack's communication
overlaps the backward pass of the layers below it. Smaller packs start sooner and leave
less exposed at the end; each costs a collective's fixed latency. Each model's local
step (the same model on every worker at once, no collective) is timed in the same
rotation, for

    overlap efficiency = local step / 2-worker step.

With `link_rates` (`benchmarks/run.py --only buckets --link-rate 1gbit,10gbit`), the
sweep is repeated behind each simulated link (`keras_dist.planning.run_in_link`).

`choose_rule` turns the sweep into keras_dist's default: the bucket size whose step is
closest to the best one on every model and link (worst-case ratio to the best).
"""

from __future__ import annotations

from benchmarks import common
from keras_dist.strategies import communication as _communication

NAME = "buckets"
MB = 1 << 20
ONE_PACK = _communication.ONE_PACK  # one pack, given per call


def settings(mode: str, *, link_rates=()) -> dict:
    return dict(
        models=common.pick(
            mode,
            smoke={"small": (32, [64])},
            quick={"2 MB": (256, [512, 512]), "9 MB": (256, [1024, 1024, 1024])},
            full={"2 MB": (256, [512, 512]), "9 MB": (256, [1024, 1024, 1024]),
                  "38 MB": (512, [2048, 2048, 2048])}),
        packs=common.pick(mode, smoke=[0, 64 << 10], quick=[0, 1 * MB, 4 * MB, 16 * MB],
                          full=[0, 256 << 10, 1 * MB, 4 * MB, 16 * MB, 64 * MB]),
        per_worker_batch=common.pick(mode, smoke=16, quick=256, full=512),
        warmup_steps=2,
        steps=common.pick(mode, smoke=2, quick=5, full=6),
        rounds=common.pick(mode, smoke=1, quick=3, full=4),
        link_rates=list(link_rates),
        # Two inter-op threads (TensorFlow's default on 2 cores): with one, TensorFlow's
        # executor can defer a cheap gradient op to the end of the backward pass and hold
        # back the first bucket (`scaling` measures both).
        intra_op_threads=1,
        inter_op_threads=2,
    )


def measure(config: dict) -> dict:
    """One worker: every (model, bucket size) in alternating timed chunks, and local steps.

    All sizes train in the same processes (one model each, its packing given per call
    by `GradientAggregation(bytes_per_pack=...)`, `ONE_PACK` for one pack), rotated each
    round, so they share the machine's state: separate launches differ by +-15% on a
    shared machine, more than the effect measured.
    """
    common.pin_threads(config["intra_op_threads"], config["inter_op_threads"])
    import tensorflow as tf

    import keras_dist

    tf.get_logger().setLevel("ERROR")  # one traced step per (model, size) is expected
    strategy = keras_dist.strategy()
    batch = config["per_worker_batch"]
    out = {}
    for name, (features, hidden) in config["models"].items():
        x, y = common.synthetic_classification(4 * batch * keras_dist.num_workers(),
                                               features)
        data = keras_dist.distribute_dataset((x, y), batch, shuffle=False, repeat=True)
        models, callbacks = {}, {}
        for pack in config["packs"]:
            with strategy.scope():
                models[pack] = common.mlp(features, hidden, seed=0)
            callbacks[pack] = [common.gradient_aggregation(
                bytes_per_pack=pack or ONE_PACK)[0]]
            common.timed_fit(models[pack], data, config["warmup_steps"], callbacks[pack])
        local = common.mlp(features, hidden, seed=0)
        local_data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
        common.timed_fit(local, local_data, config["warmup_steps"])
        order = [*config["packs"], "local"]
        steps = {key: [] for key in order}
        for round_ in range(config["rounds"]):
            shift = round_ % len(order)
            for key in order[shift:] + order[:shift]:
                model, feed, extra = ((local, local_data, []) if key == "local"
                                      else (models[key], data, callbacks[key]))
                steps[key].append(common.timed_fit(model, feed, config["steps"],
                                                   extra)["step_s"])
        out[name] = {"steps_s": {str(key): common.median(chunks)
                                 for key, chunks in steps.items()},
                     "params": sum(int(v.shape.num_elements())
                                   for v in models[config["packs"][0]].trainable_variables)}
        del models, callbacks
    return out


def sweep(config: dict) -> dict:
    """All bucket sizes on this machine's loopback (or the link this runs behind)."""
    workers = common.run_workers(measure, 2, kwargs={"config": config})
    rows = []
    for name in config["models"]:
        def slowest(key):
            return max(w[name]["steps_s"][key] for w in workers)

        local = slowest("local")
        base = slowest("0") if 0 in config["packs"] else None
        for pack in config["packs"]:
            step = slowest(str(pack))
            rows.append({"model": name, "gradient_bytes": 4 * workers[0][name]["params"],
                         "bytes_per_pack": pack, "step_ms": 1000 * step,
                         "local_step_ms": 1000 * local,
                         "overlap_efficiency": local / step,
                         "speedup_vs_one_pack": base / step if base else None})
    return {"rows": rows}


def _behind(config: dict, rate: str) -> dict:
    from keras_dist.planning import Link, run_in_link

    link = Link.parse(rate, workers=2)
    return run_in_link(sweep, link, kwargs={"config": config},
                       timeout=4 * common.WORKER_TIMEOUT)


# Sizes whose worst case is this close to the best one are a tie (the run-to-run noise
# of one cell: a 2 MB model with 16 MB, 64 MB and one pack, the same packing, spread 4%).
TIE = 0.02


def choose_rule(sweeps: dict, tie: float = TIE) -> dict:
    """The bucket size with the best worst case over all (model, link) cells.

    For each cell, every size's step time is divided by the cell's fastest; the size
    whose largest such ratio is smallest wins. Sizes within `tie` of it count as equal,
    and the largest of them is chosen: fewer collectives, which matters for models with
    many tensors and for links with a high latency, which this sweep does not cover.
    """
    cells: dict = {}
    for link, result in sweeps.items():
        for row in result["rows"]:
            cells.setdefault((link, row["model"]), {})[row["bytes_per_pack"]] = row["step_ms"]
    sizes = sorted({size for cell in cells.values() for size in cell})
    worst = {}
    for size in sizes:
        ratios = [cell[size] / min(cell.values()) for cell in cells.values() if size in cell]
        worst[size] = max(ratios)
    lowest = min(worst.values())
    best = max(size for size in sizes if worst[size] <= lowest * (1 + tie))
    return {"bytes_per_pack": best, "worst_ratio_to_best": worst,
            "cells": len(cells), "tie": tie}


def run(mode: str, link_rates=()) -> dict:
    config = settings(mode, link_rates=link_rates)
    sweeps = {"loopback": sweep(config)}
    for rate in config["link_rates"]:
        print(f"  link: {rate} per worker ...", flush=True)
        sweeps[rate] = _behind(config, rate)
    return {"sweeps": sweeps, "rule": choose_rule(sweeps), "config": config}


def report(result: dict) -> None:
    for link, outcome in result["sweeps"].items():
        common.print_table(
            f"buckets ({link}): 2-worker step by bytes_per_pack (GradientAggregation, "
            f"alternating chunks), batch {result['config']['per_worker_batch']} per worker",
            ["model", "bytes_per_pack", "step ms", "local ms", "overlap", "vs one pack"],
            [(r["model"], common.format_bytes(r["bytes_per_pack"]) if r["bytes_per_pack"]
              else "one pack", r["step_ms"], r["local_step_ms"], r["overlap_efficiency"],
              r["speedup_vs_one_pack"] if r["speedup_vs_one_pack"] else float("nan"))
             for r in outcome["rows"]],
        )
    rule = result["rule"]
    worst = ", ".join(f"{common.format_bytes(size) if size else 'one pack'} "
                      f"{ratio:.2f}" for size, ratio in rule["worst_ratio_to_best"].items())
    print(f"worst step / best step over {rule['cells']} (model, link) cells: {worst}; "
          f"chosen: {common.format_bytes(rule['bytes_per_pack'])}", flush=True)
