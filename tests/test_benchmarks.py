"""Smoke tests of benchmarks/run.py and `keras-dist bench allreduce` at minimal sizes.

They check that every benchmark runs end to end and writes its JSON keys with finite,
positive values; they assert nothing about speed (timings on CI machines mean nothing).
"""

import dataclasses
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import report  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402

# The keys each benchmark promises in results.json (README and issue 7 quote them).
REQUIRED = {
    "overhead": ("plain_eps", "keras_dist_eps", "ratio"),
    "scaling": ("eps_1", "eps_2", "efficiency"),
    "input_speed": ("ratio_min",),
    "input_sharding": ("reads_per_worker_fraction", "seed_reads_per_worker_fraction",
                       "throughput_ratio"),
    "communication": ("max_busbw_fp32_GBps", "bf16_allreduce_speedup_largest"),
    "memory": ("plain_peak_rss_mb", "accumulation_peak_rss_mb", "ratio"),
    "buckets": (),
    "engine": ("gap_largest",),
    "model_parallel": ("bytes_ratio", "bytes_ratio_1x4", "step_ratio_vs_data_parallel",
                       "step_ratio_vs_strategy", "fsdp_bytes_ratio",
                       "fsdp_step_vs_data_parallel"),
    "checkpoint": ("save_step_ratio", "bytes_ratio", "restore_ratio", "state_mb"),
}


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _run_smoke(name, tmp_path):
    output = tmp_path / "results.json"
    code = bench_run.main(["--smoke", "--only", name, "--output", str(output)])
    assert code == 0
    results = json.loads(output.read_text())
    assert results["meta"]["mode"] == "smoke"
    assert results["meta"]["nproc"] >= 1 and results["meta"]["cpu_model"]
    result = results[name]
    assert "error" not in result, result.get("error")
    for key in REQUIRED[name]:
        assert _positive_finite(result[key]), f"{name}.{key} = {result.get(key)!r}"
    return results, result


@pytest.mark.timeout(180)
@pytest.mark.multiworker
@pytest.mark.slow
def test_checkpoint_smoke(tmp_path):
    _, result = _run_smoke("checkpoint", tmp_path)
    whole, sharded = result["variants"]["whole"], result["variants"]["sharded"]
    assert whole["state_bytes"] == sharded["state_bytes"]
    # One copy of each value, in blocks; the whole file adds only HDF5's own structure.
    assert sharded["bytes_written"] == sharded["state_bytes"] < whole["bytes_written"]
    # 2 workers: both together write the state once; the whole path wrote it twice.
    workers = result["workers"]
    assert workers["written_per_state"] == 1.0 and workers["bytes_ratio"] < 0.6
    # keras_dist.strategy(): the chief writes every value once, in the background.
    assert result["strategy"]["written_per_state"] == 1.0


@pytest.mark.timeout(180)
@pytest.mark.multiworker
@pytest.mark.slow
def test_model_parallel_smoke(tmp_path):
    _, result = _run_smoke("model_parallel", tmp_path)
    variants = result["variants"]
    # Sharded kernels: less than the replicated bytes on a device, the fewer the more split.
    assert (variants["model_parallel_1x4"]["bytes_per_device"]
            < variants["model_parallel_2x2"]["bytes_per_device"]
            < variants["data_parallel"]["bytes_per_device"]
            == variants["strategy"]["bytes_per_device"])
    # FSDP: the two big kernels and their slots split in 4 (the head and biases are
    # under min_elements=1024 and replicated).
    fsdp, replicated = variants["fsdp"], variants["data_parallel"]
    assert fsdp["slots_per_device"] < replicated["slots_per_device"] / 2
    assert fsdp["params_per_device"] < replicated["params_per_device"] / 2
    # Same data, same initial weights: the same evaluated loss on every engine.
    losses = [v["loss"] for v in variants.values()]
    assert max(losses) - min(losses) < 1e-4, losses


@pytest.mark.timeout(180)
@pytest.mark.multiworker
@pytest.mark.slow
def test_overhead_smoke(tmp_path):
    _, result = _run_smoke("overhead", tmp_path)
    assert set(result["variants"]) == {"plain", "strategy", "strategy+data", "keras_dist"}
    assert set(result["cost_ms_per_step"]) == {
        "keras_dist.strategy", "keras_dist.distribute_dataset", "GradientAggregation"}
    # Installing the aggregation adds the global-norm bookkeeping to the step graph.
    assert result["ops_added"]["GradientAggregation"]


@pytest.mark.multiworker
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_input_speed_smoke(tmp_path):
    _, result = _run_smoke("input_speed", tmp_path)
    assert [(case["workers"], case["examples"]) for case in result["cases"]] == [
        (1, 2048), (2, 2048), (1, 4096), (2, 4096)]
    for case in result["cases"]:
        for pipeline in case["pipelines"].values():
            assert _positive_finite(pipeline["examples_per_s"])
            assert "rss_mb" in pipeline or case["workers"] == 2
    # The guard of issue 36, a structure not a time: without a map_fn the global order
    # reads whole batches (indices batched, then one gather per array), never a function
    # per example (a gather per example cost 10x the seed's pipeline per step).
    chain = result["structure"]
    assert result["per_example_functions"] == 0, chain
    assert chain.index("BatchDatasetV2") < chain.index("ParallelMapDatasetV2"), chain
    assert "AssertCardinalityDataset" in chain  # repeat=True says it is infinite


@pytest.mark.multiworker
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_scaling_smoke(tmp_path):
    results, result = _run_smoke("scaling", tmp_path)
    assert result["strategies"] == ["MirroredStrategy",
                                    "CollectiveAllReduceStrategy"]
    assert _positive_finite(result["breakdown_ms_2"]["gradient_all_reduce"])
    assert (tmp_path / bench_run.PLOT_NAME).stat().st_size > 0


@pytest.mark.multiworker
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_input_sharding_smoke(tmp_path):
    _, result = _run_smoke("input_sharding", tmp_path)
    # Exact counts: keras_dist maps half the data per worker, the seed all of it.
    assert result["reads_per_worker_fraction"] == pytest.approx(0.5)
    assert result["seed_reads_per_worker_fraction"] == pytest.approx(1.0)
    for pipeline in result["pipelines"].values():
        assert pipeline["examples_seen_all_workers"] == result["config"]["examples"]


@pytest.mark.multiworker
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_communication_smoke(tmp_path):
    _, result = _run_smoke("communication", tmp_path)
    paths = {row["path"] for row in result["allreduce"]}
    assert paths == {"plain_fp32", "keras_dist_fp32", "keras_dist_bf16"}
    for row in result["allreduce"]:
        assert _positive_finite(row["algbw_GBps"]) and _positive_finite(row["busbw_GBps"])
    assert all(_positive_finite(row["time_us"]) for row in result["bytes_per_pack"]["rows"])
    end_to_end = result["end_to_end"]
    assert _positive_finite(end_to_end["accumulation_speedup"])
    assert _positive_finite(end_to_end["bf16_speedup"])
    assert (tmp_path / bench_run.PLOT_NAME).stat().st_size > 0


@pytest.mark.multiworker
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_buckets_smoke(tmp_path):
    _, result = _run_smoke("buckets", tmp_path)
    rows = result["sweeps"]["loopback"]["rows"]
    assert {row["bytes_per_pack"] for row in rows} == {0, 64 << 10}
    assert all(_positive_finite(row["step_ms"]) and _positive_finite(row["overlap_efficiency"])
               for row in rows)
    assert result["rule"]["bytes_per_pack"] in (0, 64 << 10)


def test_bucket_rule_takes_the_best_worst_case():
    from benchmarks import buckets

    def sweep(steps):
        return {"rows": [{"model": model, "bytes_per_pack": size, "step_ms": ms}
                         for model, by_size in steps.items() for size, ms in by_size.items()]}

    sweeps = {"loopback": sweep({"a": {0: 100, 1: 80, 4: 85}, "b": {0: 50, 1: 45, 4: 40}}),
              "1gbit": sweep({"a": {0: 300, 1: 200, 4: 210}})}
    rule = buckets.choose_rule(sweeps, tie=0.0)
    # size 1: worst 45/40 = 1.125; size 4: worst 85/80 = 1.0625; one pack: 1.5.
    assert rule["bytes_per_pack"] == 4 and rule["cells"] == 3
    assert rule["worst_ratio_to_best"][0] == pytest.approx(1.5)
    # Within the tie, the larger size wins (fewer collectives).
    close = {"loopback": sweep({"a": {1: 100, 4: 101.5}, "b": {1: 100, 4: 100}})}
    assert buckets.choose_rule(close, tie=0.02)["bytes_per_pack"] == 4
    assert buckets.choose_rule(close, tie=0.0)["bytes_per_pack"] == 1


@pytest.mark.multiworker
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_engine_smoke(tmp_path):
    _, result = _run_smoke("engine", tmp_path)
    row = result["rows"][0]
    for key in ("reference_ms", "tensorflow_ms", "reference_busbw_GBps",
                "tensorflow_busbw_GBps", "tensorflow_cpu_ms"):
        assert _positive_finite(row[key]), key
    assert result["remedies"]


def test_engine_profile_buckets():
    from benchmarks import engine

    text = """# Samples: 100
#
    40.00%  libc.so.6                        [.] __memmove_avx_unaligned_erms
    20.00%  [kernel.kallsyms]                [k] tcp_sendmsg_locked
    15.00%  _pywrap_tensorflow_internal.so   [.] grpc_core::ExecCtx::Flush
    10.00%  libtensorflow_framework.so.2     [.] Eigen::internal::TensorExecutor<add>
     5.00%  [kernel.kallsyms]                [k] futex_wait
    10.00%  libfoo.so                        [.] something_else
"""
    result = engine.categorize(text)
    buckets = result["buckets_percent"]
    assert buckets["memory copies"] == 40 and buckets["kernel TCP / loopback"] == 20
    assert buckets["gRPC and protobuf"] == 15 and buckets["reduction arithmetic"] == 10
    assert buckets["wake-ups, locks, scheduling"] == 5 and buckets["other"] == 10
    assert result["top_symbols"][0]["symbol"] == "__memmove_avx_unaligned_erms"


@pytest.mark.timeout(180)
@pytest.mark.multiworker
@pytest.mark.slow
def test_memory_smoke(tmp_path):
    _, result = _run_smoke("memory", tmp_path)
    variants = result["variants"]
    # Same number of updates on the same effective batch; only the micro-batching differs.
    assert variants["plain"]["updates"] == variants["accumulation"]["updates"]
    assert variants["plain"]["batch"] == 4 * variants["accumulation"]["batch"]


@pytest.mark.timeout(180)
@pytest.mark.multiworker
def test_cli_bench_allreduce(tmp_path, capsys):
    # One worker keeps it short; the 2-worker sweep runs in test_communication_smoke.
    from keras_dist.launching.cli import main

    output = tmp_path / "allreduce.json"
    assert main(["bench", "allreduce", "--workers", "1", "--sizes", "1K", "4K",
                 "--output", str(output)]) == 0
    summary = json.loads(output.read_text())
    assert summary["workers"] == 1 and summary["bus_factor"] == 0.0
    assert {row["size_bytes"] for row in summary["rows"]} == {1024, 4096}
    assert {row["path"] for row in summary["rows"]} == {
        "plain_fp32", "keras_dist_fp32", "keras_dist_bf16"}
    assert all(_positive_finite(row["algbw_GBps"]) for row in summary["rows"])
    assert "busbw" in capsys.readouterr().out


def test_markdown_and_plot_from_results(tmp_path):
    results = {
        "meta": {"date": "2026-01-01T00:00:00", "nproc": 2, "cpu_model": "Test CPU",
                 "tensorflow": "2.21.0", "keras": "3.15.1", "flags": " --quick",
                 "elapsed_s": 1.0, "loadavg_start": [0.1, 0.1, 0.1]},
        "overhead": {"plain_eps": 100.0, "keras_dist_eps": 110.0, "ratio": 1.1},
        "scaling": {"eps_1": 10.0, "eps_2": 19.0, "efficiency": 0.95},
        "communication": {
            "replicas": 2, "largest_size_bytes": 1 << 20, "busbw_fp32_largest_GBps": 1.0,
            "bf16_allreduce_speedup_largest": 1.5,
            "allreduce": [{"size_bytes": s, "path": p, "busbw_GBps": 0.5}
                          for s in (1024, 1 << 20) for p in ("plain_fp32", "keras_dist_bf16")],
            "bytes_per_pack": {"rows": [{"bytes_per_pack": 0, "speedup": 1.0}]},
            "end_to_end": {"accumulation_speedup": 2.0, "bf16_speedup": 1.2},
        },
        "memory": {"error": "Traceback: boom"},
    }
    table = report.markdown(results)
    assert "Test CPU" in table and "nproc 2" in table and "2026-01-01" in table
    assert "| overhead |" in table and "| memory | failed |" in table
    path = report.plot(results, str(tmp_path / "plot.png"))
    assert os.path.getsize(path) > 0


def test_linksim_fit_validation_and_plot_from_groups(tmp_path, capsys):
    # linksim's analysis on groups made from a known engine (no processes): the fit
    # recovers the engine, the model then predicts the linked groups exactly, and the
    # report and plot run. The measuring part runs under `--link-rate` (and its
    # run_in_link/measure_link machinery in tests/test_planning.py).
    from benchmarks import linksim
    from keras_dist import planning

    alpha, beta, params, compute_ms = 400e-6, 3e-9, 1_000_000, 50.0
    sizes = [1 << s for s in range(16, 25, 2)]
    groups = []
    for rate in (None, 1e9, 10e9):
        link_beta = beta + (8 / rate if rate else 0)
        times = [planning.allreduce_time(size, 2, alpha, link_beta) for size in sizes]
        groups.append({
            "workers": 2, "rate_bps": rate, "qdisc_rate_bps": rate and 2 * rate,
            "raw_tcp_per_worker_bps": rate or 5e9, "params": params,
            "allreduce": [{"size_bytes": s, "time_us": 1e6 * t, "busbw_bps": 8 * s / t}
                          for s, t in zip(sizes, times)],
            "compute_ms": compute_ms,
            "step_ms": compute_ms + 1000 * planning.allreduce_time(4 * params, 2, alpha,
                                                                    link_beta),
        })
    fit = linksim._fit(groups)
    assert fit["engine"].alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit["engine"].beta_s_per_byte == pytest.approx(beta, rel=1e-6)
    assert [f["effective_rate_bps"] for f in fit["per_rate"]] == [pytest.approx(1e9),
                                                                  pytest.approx(10e9)]
    calibration = linksim._calibrate(groups, fit["engine"])
    assert calibration[2]["overhead_ms"] == pytest.approx(0, abs=1e-6)
    checks = linksim._validate(groups, fit["engine"], calibration)
    assert all(abs(check["step_rel_error"]) < 1e-6 for check in checks)
    engine = fit["engine"]
    result = {"groups": groups, "engine": dataclasses.asdict(engine),
              "engine_busbw_GBps": 1 / beta / 1e9, "fit_max_rel_error": 0.0,
              "per_rate_fits": fit["per_rate"], "validation": checks,
              "model_params": params, "model_compute_ms": compute_ms,
              "predictions": linksim._predictions(params, compute_ms, engine)}
    linksim.report(result)
    assert "validation" in capsys.readouterr().out
    assert os.path.getsize(linksim.plot(result, str(tmp_path / linksim.PLOT_NAME))) > 0
