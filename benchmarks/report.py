"""The README's view of a results file: a markdown table and the scaling/bandwidth plot.

    python benchmarks/run.py --markdown benchmarks/results/results.json
"""

from __future__ import annotations

import math

_GOALS = {
    ("overhead", "ratio"): ">= 1.0",
    ("input_speed", "ratio_min"): ">= 1.0",
    ("scaling", "efficiency"): ">= 0.9",
    ("input_sharding", "reads_per_worker_fraction"): "1/workers",
    ("memory", "ratio"): "< 1",
    ("model_parallel", "bytes_ratio"): "~ 1/2 (+ replicated)",
    ("model_parallel", "fsdp_bytes_ratio"): "~ 1/4 (+ replicated)",
    ("checkpoint", "save_step_ratio"): "<= 1.5",
    ("checkpoint", "bytes_ratio"): "<= 1.0",
    ("checkpoint", "workers_save_step_ratio"): "<= 1.5",
    ("checkpoint", "workers_written_per_state"): "<= 1.3",
}


def _number(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _rows(results: dict) -> list[tuple]:
    rows = []

    def add(bench, key, label, value, digits=3):
        rows.append((bench, label, _number(value, digits), _GOALS.get((bench, key), "")))

    overhead = results.get("overhead")
    if overhead and "ratio" in overhead:
        add("overhead", "ratio", "examples/s keras_dist / plain tf.distribute (seed MLP, "
            "2 virtual CPUs)", overhead["ratio"])
        add("overhead", "plain_eps", "examples/s plain / keras_dist",
            f"{overhead['plain_eps']:,.0f} / {overhead['keras_dist_eps']:,.0f}")
    speed = results.get("input_speed")
    if speed and "cases" in speed:
        add("input_speed", "ratio_min", "input examples/s distribute_dataset / seed "
            "pipeline, iterator alone, worst of "
            f"{len(speed['cases'])} (arrays x workers)", speed["ratio_min"], 2)
        for case in speed["cases"]:
            pipelines = case["pipelines"]
            memory = (f"; memory +MB {pipelines['plain']['rss_mb']:,.0f} / "
                      f"{pipelines['keras_dist']['rss_mb']:,.0f}"
                      if "rss_mb" in pipelines["plain"] else "")
            add("input_speed", "case", f"  {case['examples']:,} x {case['features']}, "
                f"{case['workers']} worker(s): ratio" + ("; memory +MB seed / keras_dist"
                                                         if memory else ""),
                f"{case['ratio']:.2f}{memory}")
    scaling = results.get("scaling")
    if scaling and "efficiency" in scaling:
        threads = scaling.get("inter_op_threads", 1)
        add("scaling", "efficiency", "scaling efficiency eps_2 / (2 eps_1), compute-bound MLP, "
            f"1 intra-op + {threads} inter-op thread(s) per worker", scaling["efficiency"])
        add("scaling", "eps", "examples/s 1 worker / 2 workers",
            f"{scaling['eps_1']:,.0f} / {scaling['eps_2']:,.0f}")
        if "overlap_efficiency" in scaling:
            add("scaling", "overlap", "overlap efficiency local step / 2-worker step: "
                "bucketed (default) / one pack (before)",
                f"{scaling['overlap_efficiency']:.3f} / "
                f"{scaling['overlap_efficiency_one_pack']:.3f}")
            add("scaling", "overlap_vs_bound", "overlap / bound local / (local + "
                "all-reduce CPU)", f"{scaling['overlap_vs_bound']:.2f} x "
                f"{scaling['overlap_bound']:.3f}")
            add("scaling", "efficiency_one_pack", "scaling efficiency with one pack "
                "(before)", scaling["efficiency_one_pack"])
    sharding = results.get("input_sharding")
    if sharding and "throughput_ratio" in sharding:
        add("input_sharding", "reads_per_worker_fraction",
            "fraction of the data each of 2 workers reads+maps: keras_dist / seed",
            f"{sharding['reads_per_worker_fraction']:.2f} / "
            f"{sharding['seed_reads_per_worker_fraction']:.2f}")
        add("input_sharding", "throughput_ratio", "input throughput keras_dist / seed "
            "(expensive map_fn)", sharding["throughput_ratio"], 2)
    comm = results.get("communication")
    if comm and "allreduce" in comm:
        largest = comm["largest_size_bytes"] >> 20
        add("communication", "busbw", f"all-reduce busbw fp32, {largest} MB, "
            f"{comm['replicas']} workers (GB/s)", comm["busbw_fp32_largest_GBps"])
        add("communication", "bf16", f"all-reduce time fp32 / bf16 compression, {largest} MB",
            comm["bf16_allreduce_speedup_largest"], 2)
        packs = comm["bytes_per_pack"]["rows"]
        best = max(packs, key=lambda row: row["speedup"])
        add("communication", "packs", "best bytes_per_pack (speedup vs TF default)",
            f"{best['bytes_per_pack']} ({best['speedup']:.2f})")
        e2e = comm["end_to_end"]
        add("communication", "accumulation", "step time plain / GradientAggregation("
            "accumulation_steps=4), comm-heavy MLP", e2e["accumulation_speedup"], 2)
        add("communication", "bf16_e2e", "step time plain / GradientAggregation("
            "compression='bf16')", e2e["bf16_speedup"], 2)
    buckets = results.get("buckets")
    if buckets and "rule" in buckets:
        rule = buckets["rule"]
        worst = {int(size): ratio for size, ratio in rule["worst_ratio_to_best"].items()}
        chosen = int(rule["bytes_per_pack"])
        add("buckets", "rule", f"bytes_per_pack with the best worst case over {rule['cells']}"
            " (model, link) cells (its worst step / best; one pack's)",
            f"{chosen >> 20} MB ({worst[chosen]:.2f}; {worst.get(0, float('nan')):.2f})"
            if chosen >= 1 << 20 else f"{chosen} ({worst[chosen]:.2f})")
    engine = results.get("engine")
    if engine and "rows" in engine:
        largest = engine["rows"][-1]
        add("engine", "gap", f"all-reduce time TensorFlow / numpy+socket ring, "
            f"{largest['size_bytes'] >> 20} MB, 2 workers", largest["gap"], 2)
        add("engine", "busbw", "busbw TensorFlow / numpy+socket ring (GB/s)",
            f"{largest['tensorflow_busbw_GBps']:.2f} / {largest['reference_busbw_GBps']:.2f}")
    memory = results.get("memory")
    if memory and "ratio" in memory:
        add("memory", "ratio", "peak RSS accumulation k=4 at b / plain at 4b", memory["ratio"])
        add("memory", "increase", "training RSS increase accumulation / plain (MB)",
            f"{memory['accumulation_increase_mb']:.0f} / {memory['plain_increase_mb']:.0f}")
    parallel = results.get("model_parallel")
    if parallel and "bytes_ratio" in parallel:
        add("model_parallel", "bytes_ratio", "bytes per device ModelParallel (2,2) / "
            "DataParallel(4)", parallel["bytes_ratio"])
        add("model_parallel", "bytes_ratio_1x4", "bytes per device ModelParallel (1,4) / "
            "DataParallel(4)", parallel["bytes_ratio_1x4"])
        add("model_parallel", "step_dp", "step time ModelParallel (2,2) / DataParallel(4)",
            parallel["step_ratio_vs_data_parallel"], 2)
        add("model_parallel", "step_strategy", "step time ModelParallel (2,2) / "
            "keras_dist.strategy() (4 devices)", parallel["step_ratio_vs_strategy"], 2)
        if "fsdp_bytes_ratio" in parallel:
            add("model_parallel", "fsdp_bytes_ratio", "bytes per device FSDP / "
                "DataParallel(4)", parallel["fsdp_bytes_ratio"])
            add("model_parallel", "fsdp_step_dp", "step time FSDP / DataParallel(4)",
                parallel["fsdp_step_vs_data_parallel"], 2)
    checkpoint = results.get("checkpoint")
    if checkpoint and "save_step_ratio" in checkpoint:
        add("checkpoint", "save_step_ratio", f"step with a sharded backup / without (FSDP, "
            f"{checkpoint['state_mb']:.0f} MB of state, every 4 steps)",
            checkpoint["save_step_ratio"], 2)
        add("checkpoint", "whole_save_step_ratio", "the same with the whole-value file",
            checkpoint["whole_save_step_ratio"], 2)
        add("checkpoint", "bytes_ratio", "bytes written per backup sharded / whole",
            checkpoint["bytes_ratio"])
        add("checkpoint", "restore_ratio", "restore time sharded / whole",
            checkpoint["restore_ratio"], 2)
        workers = checkpoint.get("workers")
        if workers:
            add("checkpoint", "workers_save_step_ratio", "2 workers x 2 CPUs: step with a "
                "sharded backup / without", workers["save_step_ratio"], 2)
            add("checkpoint", "workers_written_per_state", "2 workers x 2 CPUs: bytes "
                "written per backup (both) / state", workers["written_per_state"])
            add("checkpoint", "workers_bytes_ratio", "2 workers x 2 CPUs: bytes written "
                "sharded / whole (both)", workers["bytes_ratio"])
    for name, result in results.items():
        if isinstance(result, dict) and "error" in result:
            rows.append((name, "failed", result["error"].splitlines()[0][:80], ""))
    return rows


def markdown(results: dict) -> str:
    """A markdown table of the headline figures, with the date and machine above it."""
    meta = results.get("meta", {})
    load = meta.get("loadavg_start")
    load_text = f", load average at start {load[0]:.2f}" if load else ""
    lines = [
        f"Measured {meta.get('date', '?')} on {meta.get('cpu_model', '?')} "
        f"(nproc {meta.get('nproc', '?')}{load_text}), "
        f"TensorFlow {meta.get('tensorflow', '?')}, Keras {meta.get('keras', '?')}, "
        f"`benchmarks/run.py{meta.get('flags', '')}` ({meta.get('elapsed_s', 0):.0f} s).",
        "",
        "| benchmark | figure | value | goal |",
        "| --- | --- | ---: | --- |",
    ]
    lines += [f"| {b} | {label} | {value} | {goal} |" for b, label, value, goal in _rows(results)]
    return "\n".join(lines)


def plot(results: dict, path: str) -> str | None:
    """Writes the scaling (left) and all-reduce bus bandwidth (right) figure; returns path."""
    scaling, comm = results.get("scaling"), results.get("communication")
    has_scaling = bool(scaling) and "eps_1" in scaling
    has_comm = bool(comm) and "allreduce" in comm
    if not (has_scaling or has_comm):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if has_scaling:
        measured = [scaling["eps_1"], scaling["eps_2"]]
        ideal = [scaling["eps_1"], 2 * scaling["eps_1"]]
        left.bar([0.8, 1.8], ideal, width=0.4, color="#cccccc", label="ideal (linear)")
        left.bar([1.2, 2.2], measured, width=0.4, color="#1f77b4", label="measured")
        left.set_xticks([1, 2], ["1 worker", "2 workers"])
        left.set_ylabel("examples / s")
        left.set_title(f"scaling: efficiency {scaling['efficiency']:.2f}")
        left.legend()
    else:
        left.set_axis_off()
    if has_comm:
        paths: dict = {}
        for row in comm["allreduce"]:
            paths.setdefault(row["path"], []).append(row)
        for name, rows in paths.items():
            label = f"{name} (bytes moved)" if name.endswith("bf16") else name
            right.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows],
                       marker="o", label=label)
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.set_xlabel("tensor size (bytes of float32)")
        right.set_ylabel("bus bandwidth (GB/s)")
        right.set_title(f"all-reduce on {comm['replicas']} workers (busbw, nccl-tests)")
        right.grid(True, which="both", alpha=0.3)
        right.legend()
    else:
        right.set_axis_off()
    meta = results.get("meta", {})
    figure.suptitle(f"keras_dist benchmarks ({meta.get('mode', '?')}), "
                    f"{meta.get('date', '')[:10]}, {meta.get('cpu_model', '?')}, "
                    f"nproc {meta.get('nproc', '?')}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
