"""linksim: all-reduce and training behind simulated links; the alpha-beta model fitted and checked.

    python benchmarks/run.py --link-rate 1gbit,10gbit --quick     # ~5-10 min on 2 cores
    python benchmarks/run.py --link-rate 1gbit,10gbit --link-workers 2,4

For the unlimited loopback and each link rate, one group of launched workers runs inside a
private network namespace whose loopback is rate-limited with tc (`keras_dist.planning.
run_in_link`; needs root or CAP_NET_ADMIN). Each group measures:

1. **the link**: raw TCP throughput per worker in a ring of sockets (no TensorFlow), the
   achieved rate against the set one;
2. **the all-reduce sweep**: keras_dist's fp32 gradient path (`_bench.sweep`), 64 KB ..
   16 MB (full: 16 KB .. 64 MB);
3. **training**: an MLP step on one worker alone with every worker busy the same way
   ("compute under the same load"), then the same model data-parallel on all workers.

Then the model (`keras_dist.planning`): `alpha` and `beta_engine` are fitted on the
unlimited loopback; each link adds `8 / rate` per byte. The prediction for each link,
`t = 2(N-1) alpha + 2(N-1)/N B (beta_engine + 8/rate)` and `step = compute + t`
(nothing overlapped today, no per-step overhead), is compared with what the group measured
there: the relative errors are the validation. The fitted engine goes to
`keras_dist/planning/measured_engine.json` (`keras-dist plan --engine measured`), the
predictions for N = 2..256 at 1/10/25/100 Gbit (fp32, bf16, accumulation 4; measured and
ideal engine) into the results, and the plot `scaling_model.png` next to the JSON.

Every worker has 1 intra-op and 1 inter-op thread, as in `scaling`, so 2 workers share 2
cores; with 4 workers the cores are oversubscribed and the figures say so.
"""

from __future__ import annotations

import json
import os

from benchmarks import common

NAME = "linksim"
DEFAULT_RATES = ("1gbit", "10gbit")
PREDICT_RATES = ("1gbit", "10gbit", "25gbit", "100gbit")
PREDICT_WORKERS = (2, 4, 8, 16, 32, 64, 128, 256)
VARIANTS = (("fp32", "none", 1), ("bf16", "bf16", 1), ("accumulation_4", "none", 4))
PLOT_NAME = "scaling_model.png"


def settings(mode: str, *, link_rates=DEFAULT_RATES, link_workers=(2,)) -> dict:
    return dict(
        link_rates=list(link_rates),
        link_workers=list(link_workers),
        sizes=common.pick(mode, smoke=[1 << 16, 1 << 20],
                          quick=[1 << s for s in range(16, 25, 2)],
                          full=[1 << s for s in range(14, 27, 2)]),
        budget_bytes=common.pick(mode, smoke=2 << 20, quick=32 << 20, full=256 << 20),
        raw_link_bytes=common.pick(mode, smoke=1 << 20, quick=16 << 20, full=64 << 20),
        features=common.pick(mode, smoke=32, quick=256, full=256),
        hidden=common.pick(mode, smoke=[64], quick=[1024, 1024], full=[1024, 1024, 1024]),
        per_worker_batch=common.pick(mode, smoke=16, quick=128, full=512),
        warmup_steps=common.pick(mode, smoke=2, quick=3, full=4),
        steps=common.pick(mode, smoke=3, quick=6, full=10),
        rounds=common.pick(mode, smoke=1, quick=2, full=3),
        # The sweep runs this often; each size keeps its fastest time (least disturbed
        # by other processes on a shared machine).
        sweep_repeats=common.pick(mode, smoke=1, quick=2, full=3),
        write_engine=mode != "smoke",
    )


def measure(config: dict) -> dict:
    """One worker: the all-reduce sweep, then local and data-parallel training."""
    common.pin_threads(1, 1)
    import tensorflow as tf

    import keras_dist
    from keras_dist.planning import bench as _bench

    tf.get_logger().setLevel("ERROR")
    strategy = keras_dist.strategy()
    workers = keras_dist.num_workers()
    sweeps = [_bench.sweep(strategy, config["sizes"], ["keras_dist_fp32"],
                           budget_bytes=config["budget_bytes"])
              for _ in range(config.get("sweep_repeats", 1))]
    sweep = [min(rows, key=lambda row: row["time_us"]) for rows in zip(*sweeps)]
    batch = config["per_worker_batch"]
    x, y = common.synthetic_classification(4 * batch * workers, config["features"])
    # Outside any scope: the default strategy, no collective; every worker runs it at
    # once, so it feels the same contention for cores as a training step.
    local_model = common.mlp(config["features"], config["hidden"], seed=0)
    local_data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    data = keras_dist.distribute_dataset((x, y), batch, shuffle=False, repeat=True)
    with strategy.scope():
        model = common.mlp(config["features"], config["hidden"], seed=0)
    common.timed_fit(local_model, local_data, config["warmup_steps"])
    common.timed_fit(model, data, config["warmup_steps"])
    local, distributed = [], []
    for _ in range(config["rounds"]):
        local.append(common.timed_fit(local_model, local_data, config["steps"])["step_s"])
        distributed.append(common.timed_fit(model, data, config["steps"])["step_s"])
    params = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    return {"replicas": strategy.num_replicas_in_sync, "sweep": sweep, "params": params,
            "local_step_s": common.median(local), "step_s": common.median(distributed)}


def _group(config: dict, workers: int) -> dict:
    """Runs behind the link: the raw link rate, then `measure` on `workers` workers."""
    from keras_dist.planning import measure_link
    from keras_dist.testing import run_on_workers

    raw = measure_link(workers, config["raw_link_bytes"], repeats=2)
    results = run_on_workers(measure, workers, kwargs={"config": config},
                             timeout=common.WORKER_TIMEOUT)
    return {"raw_link": raw, "results": results}


def _summarize_group(outcome: dict, link) -> dict:
    from keras_dist.planning import bench as _bench

    results = outcome["results"]
    rows = _bench.summarize([{"replicas": r["replicas"], "rows": r["sweep"]}
                             for r in results])["rows"]
    workers = len(results)
    return {
        "workers": workers,
        "rate_bps": link.rate_bps,
        "qdisc_rate_bps": link.qdisc_rate_bps,
        "raw_tcp_per_worker_bps": outcome["raw_link"]["per_worker_bps"],
        "allreduce": [{"size_bytes": r["size_bytes"], "time_us": r["time_us"],
                       "busbw_bps": 8e9 * r["busbw_GBps"]} for r in rows],
        "params": results[0]["params"],
        # A step ends together everywhere: the slowest worker's figures.
        "compute_ms": 1000 * max(r["local_step_s"] for r in results),
        "step_ms": 1000 * max(r["step_s"] for r in results),
    }


def _fit(groups: list) -> dict:
    from keras_dist.planning import Engine, fit_alpha_beta

    # The engine comes from the smallest group on unlimited loopback (2 workers: one
    # core each); larger groups, and every link, are predictions out of sample.
    smallest = min(g["workers"] for g in groups if g["rate_bps"] is None)
    base = [g for g in groups if g["rate_bps"] is None and g["workers"] == smallest]
    samples = [(g["workers"], r["size_bytes"], r["time_us"] / 1e6)
               for g in base for r in g["allreduce"]]
    alpha, beta, error = fit_alpha_beta(samples)
    engine = Engine("measured", alpha, beta,
                    f"fitted: TensorFlow's gRPC ring all-reduce on CPU, {smallest} workers "
                    f"on unlimited loopback, {common.cpu_model()}, {os.cpu_count()} cores")
    per_rate = []
    for group in groups:
        if group in base:
            continue
        a, b, e = fit_alpha_beta([(group["workers"], r["size_bytes"], r["time_us"] / 1e6)
                                  for r in group["allreduce"]])
        link_beta = b - beta if group["rate_bps"] else 0.0
        per_rate.append({"workers": group["workers"], "rate_bps": group["rate_bps"],
                         "alpha_us": 1e6 * a, "beta_ns_per_byte": 1e9 * b,
                         "fit_max_rel_error": e,
                         # 8 / (beta - beta_engine): the link's rate as the model sees it
                         "effective_rate_bps": 8 / link_beta if link_beta > 0 else None})
    per_rate.sort(key=lambda f: (f["workers"], f["rate_bps"] or 0))
    return {"engine": engine, "fit_max_rel_error": error, "per_rate": per_rate}


def _calibrate(groups: list, engine) -> dict:
    """Per worker count, from the unlimited loopback: the step beyond compute + all-reduce.

    Reported beside the model's error, not used by it: on a loaded machine one noisy
    loopback step makes it worse (measured: +39% instead of +18%).

    residual = step - compute - t(gradient): > 0 is a fixed overhead per distributed step
    (`overhead_ms`); the links then change only t, which is what the validation tests.
    """
    calibration = {}
    for group in groups:
        if group["rate_bps"] is not None:
            continue
        comm_ms = 1000 * engine.time(4 * group["params"], group["workers"], None)
        residual = group["step_ms"] - group["compute_ms"] - comm_ms
        # Overlap stays 0 in the model: what the buckets hide is measured by
        # benchmarks/scaling.py and given to `predict(overlap=...)` by the user; here a
        # negative residual is the model's error (or overlap), reported as such.
        calibration[group["workers"]] = {
            "residual_ms": residual,
            "overhead_ms": max(0.0, residual),
            "overlap": 0.0,
        }
    return calibration


def _validate(groups: list, engine, calibration: dict) -> list:
    rows = []
    for group in groups:
        n, rate = group["workers"], group["rate_bps"]
        grad_bytes = 4 * group["params"]
        errors = [engine.time(r["size_bytes"], n, rate) / (r["time_us"] / 1e6) - 1
                  for r in group["allreduce"]]
        comm_ms = 1000 * engine.time(grad_bytes, n, rate)
        cal = calibration.get(n, {"overhead_ms": 0.0, "overlap": 0.0})
        compute = group["compute_ms"]
        # The model as documented: compute + all-reduce, nothing hidden, no overhead.
        predicted_step = compute + comm_ms
        calibrated_step = compute + cal["overhead_ms"] + comm_ms - min(
            comm_ms, cal["overlap"] * compute)
        rows.append({
            "workers": n, "rate_bps": rate,
            "allreduce_rel_errors": errors,
            "allreduce_max_abs_rel_error": max(abs(e) for e in errors),
            "allreduce_largest_rel_error": errors[-1],
            "gradient_bytes": grad_bytes,
            "compute_ms": compute,
            "allreduce_pred_ms": comm_ms,
            "overhead_ms": cal["overhead_ms"],
            "overlap": cal["overlap"],
            "step_measured_ms": group["step_ms"],
            "step_predicted_ms": predicted_step,
            "step_rel_error": predicted_step / group["step_ms"] - 1,
            # With the per-step overhead fitted on loopback (noisy on a loaded machine).
            "step_calibrated_rel_error": calibrated_step / group["step_ms"] - 1,
        })
    return rows


def _predictions(params: int, compute_ms: float, engine, overhead_ms: float = 0.0,
                 overlap: float = 0.0) -> dict:
    from keras_dist.planning import load_engine, predict

    table = {}
    for engine_name, model in (("measured", engine), ("ideal", load_engine("ideal"))):
        for variant, compression, accumulation in VARIANTS:
            rows = predict(params, compute_ms, link_rate=list(PREDICT_RATES),
                           workers=PREDICT_WORKERS, compression=compression,
                           accumulation=accumulation, engine=model,
                           overhead_ms=overhead_ms, overlap=overlap)
            table[f"{engine_name}/{variant}"] = [row.as_dict() for row in rows]
    return table


def run(mode: str, **options) -> dict:
    from keras_dist.planning import Link, LinkSimulatorError, check_support, run_in_link

    config = settings(mode, **options)
    links = [Link.parse(rate, workers=n) for n in config["link_workers"]
             for rate in [None] + config["link_rates"]]
    for link in links:
        check_support(link)  # a clear error before anything runs
    groups, failed = [], []
    for link in links:
        print(f"  link: {link.describe()} ...", flush=True)
        try:
            outcome = run_in_link(_group, link,
                                  kwargs={"config": config, "workers": link.workers},
                                  timeout=2 * common.WORKER_TIMEOUT)
        except (LinkSimulatorError, TimeoutError) as error:
            # Keep the other groups' measurements; the failure is recorded and printed.
            print(f"  link: {link.describe()} failed: {error}", flush=True)
            failed.append({"link": link.describe(), "error": str(error)})
            continue
        groups.append(_summarize_group(outcome, link))
    if not any(g["rate_bps"] is None for g in groups):
        raise RuntimeError(f"linksim: the unlimited-loopback group failed: {failed}")
    result = analyze(groups, config)
    result["failed_groups"] = failed
    if config["write_engine"]:
        write_engine(result)
    return result


def write_engine(result: dict) -> str:
    """Saves the fitted engine for `keras-dist plan --engine measured`; returns the path."""
    from keras_dist.planning.model import MEASURED_ENGINE_FILE

    with open(MEASURED_ENGINE_FILE, "w", encoding="utf-8") as file:
        json.dump({"engine": result["engine"], "date": common.machine_info()["date"],
                   "fit_max_rel_error": result["fit_max_rel_error"],
                   "overhead_ms_2_workers": result["model_overhead_ms"],
                   "written_by": "python benchmarks/run.py --link-rate ..."}, file, indent=2)
        file.write("\n")
    return MEASURED_ENGINE_FILE


def analyze(groups: list, config: dict) -> dict:
    """The fit, calibration, validation and predictions from measured `groups`.

    `python -c "from benchmarks import linksim; ..."` can redo it from a saved
    linksim.json: `linksim.analyze(saved["groups"], saved["config"])`.
    """
    fit = _fit(groups)
    engine = fit["engine"]
    base = next(g for g in groups if g["rate_bps"] is None and g["workers"] == 2) \
        if any(g["workers"] == 2 for g in groups) else groups[0]
    calibration = _calibrate(groups, engine)
    cal = calibration.get(base["workers"], {"overhead_ms": 0.0, "overlap": 0.0})
    result = {
        "groups": groups,
        "engine": {"alpha_s": engine.alpha_s, "beta_s_per_byte": engine.beta_s_per_byte,
                   "name": engine.name, "source": engine.source},
        "engine_busbw_GBps": 1 / engine.beta_s_per_byte / 1e9 if engine.beta_s_per_byte
        else None,
        "fit_max_rel_error": fit["fit_max_rel_error"],
        "per_rate_fits": fit["per_rate"],
        "calibration": {str(n): c for n, c in calibration.items()},
        "validation": _validate(groups, engine, calibration),
        "model_params": base["params"],
        "model_compute_ms": base["compute_ms"],
        "model_overhead_ms": 0.0,
        "model_overlap": 0.0,
        "loopback_overhead_ms": cal["overhead_ms"],
        "predictions": _predictions(base["params"], base["compute_ms"], engine),
        "config": config,
    }
    linked = [v for v in result["validation"] if v["rate_bps"] is not None]
    result["max_abs_step_rel_error"] = max(abs(v["step_rel_error"]) for v in linked)
    result["max_abs_step_calibrated_rel_error"] = max(
        abs(v["step_calibrated_rel_error"]) for v in linked)
    result["max_abs_allreduce_largest_rel_error"] = max(
        abs(v["allreduce_largest_rel_error"]) for v in linked)
    return result


def plot(result: dict, path: str) -> str | None:
    """Efficiency against workers: measured (left) and ideal (right) engine."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from keras_dist.planning import format_rate, parse_rate

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = dict(zip(PREDICT_RATES, ("tab:red", "tab:orange", "tab:green", "tab:blue")))
    styles = {"fp32": "-", "bf16": "--", "accumulation_4": ":"}
    for axis, engine_name in zip(axes, ("measured", "ideal")):
        for variant, _, _ in VARIANTS:
            rows = result["predictions"][f"{engine_name}/{variant}"]
            for rate in PREDICT_RATES:
                points = [r for r in rows if r["link_rate_bps"] == parse_rate(rate)]
                axis.plot([r["workers"] for r in points], [r["efficiency"] for r in points],
                          styles[variant], color=colors[rate], marker=".",
                          label=f"{format_rate(parse_rate(rate))} {variant}")
        for check in result["validation"]:
            if check["rate_bps"] is not None and engine_name == "measured":
                axis.plot([check["workers"]],
                          [check["compute_ms"] / check["step_measured_ms"]], "kx",
                          markersize=9)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("workers")
        axis.set_title(f"{engine_name} engine" + (" (TF gRPC ring, CPU; x = simulated link)"
                                                   if engine_name == "measured" else
                                                   " (link-limited, NCCL-class)"))
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (compute / step)")
    axes[1].legend(fontsize=7, ncol=3, loc="lower left")
    figure.suptitle(f"predicted: {result['model_params']:,}-param MLP, "
                    f"{result['model_compute_ms']:.0f} ms compute per worker step",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def report(result: dict) -> None:
    from keras_dist.planning import format_rate, parse_rate

    engine = result["engine"]
    print(f"\nlinksim: engine fitted on unlimited loopback: alpha "
          f"{engine['alpha_s'] * 1e6:.0f} us per ring step, beta "
          f"{engine['beta_s_per_byte'] * 1e9:.3f} ns/byte "
          f"({(result['engine_busbw_GBps'] or float('nan')):.2f} GB/s); "
          f"fit max error {result['fit_max_rel_error']:.0%}")
    common.print_table(
        "links: set vs achieved per worker (loopback tbf = workers x rate; one qdisc)",
        ["workers", "set", "raw TCP", "all-reduce busbw (largest)", "effective rate (fit)"],
        [(g["workers"], format_rate(g["rate_bps"]), format_rate(g["raw_tcp_per_worker_bps"]),
          format_rate(g["allreduce"][-1]["busbw_bps"]),
          next((format_rate(f["effective_rate_bps"]) if f["effective_rate_bps"] else "n/a"
                for f in result["per_rate_fits"] if f["workers"] == g["workers"]
                and f["rate_bps"] == g["rate_bps"]), "-"))
         for g in result["groups"]],
    )
    common.print_table(
        "validation: model (step = compute + all-reduce; engine fitted on loopback + 8/rate) "
        "vs measured behind the link",
        ["workers", "link", "compute ms", "overhead ms", "overlap", "step measured",
         "step predicted", "step error", "error with loopback overhead",
         "all-reduce error (largest)",
         "max all-reduce error"],
        [(v["workers"], format_rate(v["rate_bps"]), v["compute_ms"], v["overhead_ms"],
          v["overlap"], v["step_measured_ms"],
          v["step_predicted_ms"], f"{v['step_rel_error']:+.0%}",
          f"{v['step_calibrated_rel_error']:+.0%}",
          f"{v['allreduce_largest_rel_error']:+.0%}",
          f"{v['allreduce_max_abs_rel_error']:.0%}") for v in result["validation"]],
    )
    columns = [format_rate(parse_rate(rate)) for rate in PREDICT_RATES]
    table = []
    for key, rows in result["predictions"].items():
        for workers in (2, 64, 256):
            by_rate = {r["link_rate_bps"]: r["efficiency"] for r in rows
                       if r["workers"] == workers}
            table.append([key, workers] + [by_rate[parse_rate(rate)] for rate in PREDICT_RATES])
    common.print_table(
        f"predicted scaling efficiency ({result['model_params']:,}-param MLP, "
        f"{result['model_compute_ms']:.0f} ms compute per worker step, overhead "
        f"{result.get('model_overhead_ms', 0):.1f} ms, "
        f"overlap {result.get('model_overlap', 0):.2f})",
        ["engine/variant", "workers"] + columns, table)


def markdown(result: dict) -> str:
    """The README's tables: links set vs achieved, validation, predictions at 64 workers."""
    from keras_dist.planning import format_rate, parse_rate

    def pct(value):
        return f"{value:+.0%}"

    lines = ["| workers | link (per worker) | raw TCP achieved | all-reduce busbw, "
             f"{result['groups'][0]['allreduce'][-1]['size_bytes'] >> 20} MB | compute ms | "
             "step measured ms | step predicted ms | error | error, + loopback overhead |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    checks = {(v["workers"], v["rate_bps"]): v for v in result["validation"]}
    for group in result["groups"]:
        check = checks[(group["workers"], group["rate_bps"])]
        lines.append(
            f"| {group['workers']} | {format_rate(group['rate_bps'])} | "
            f"{format_rate(group['raw_tcp_per_worker_bps'])} | "
            f"{format_rate(group['allreduce'][-1]['busbw_bps'])} | {check['compute_ms']:.0f} | "
            f"{check['step_measured_ms']:.0f} | {check['step_predicted_ms']:.0f} | "
            f"{pct(check['step_rel_error'])} | {pct(check['step_calibrated_rel_error'])} |")
    lines += ["", "| engine / variant | " + " | ".join(
        format_rate(parse_rate(rate)) for rate in PREDICT_RATES) + " |",
        "| --- |" + " ---: |" * len(PREDICT_RATES)]
    for key, rows in result["predictions"].items():
        by_rate = {r["link_rate_bps"]: r for r in rows if r["workers"] == 64}
        lines.append(f"| {key} | " + " | ".join(
            f"{by_rate[parse_rate(rate)]['efficiency']:.2f}" for rate in PREDICT_RATES) + " |")
    return "\n".join(lines)
