"""Run keras_dist's benchmarks: each prints a table; all write into one JSON file.

    python benchmarks/run.py                    # the full run (quiet machine: ~15 min)
    python benchmarks/run.py --quick            # everything in < 5 minutes on 2 cores
    python benchmarks/run.py --only overhead,memory --output /tmp/r.json
    python benchmarks/run.py --markdown benchmarks/results/results.json   # README table
    python benchmarks/run.py --link-rate 1gbit,10gbit --quick   # link simulator + model

Every figure is a ratio against plain tf.distribute (the seed's way) measured in the
same run (pipeline: against GPipe's bubble model; engine: against a numpy + socket ring).
Benchmarks: overhead, input_speed, scaling, input_sharding, communication, memory, sparse_accumulation,
pipeline, buckets, engine, model_parallel, checkpoint (one module each in benchmarks/); `--only buckets --link-rate
1gbit,10gbit` repeats the bucket-size sweep behind simulated links. The JSON goes to
`--output` (default
benchmarks/results/results.json), the plot `scaling_bandwidth.png` next to it, and a
markdown summary is printed at the end. Each measurement runs in fresh processes; this
one never imports TensorFlow. `--smoke` is for the tests: minimal sizes, meaningless
timings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from typing import Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    # `python benchmarks/run.py` from a checkout: make `benchmarks` and `keras_dist`
    # importable here and (through the launcher's PYTHONPATH) in the workers.
    sys.path.insert(0, _ROOT)

BENCHMARKS = ("overhead", "input_speed", "scaling", "input_sharding", "communication", "memory",
              "sparse_accumulation", "pipeline", "buckets", "engine", "model_parallel",
              "checkpoint")
_DEVICE_AWARE = ("overhead", "communication")  # take --device/--replicas/... options
# Only on request (`--link-rate` or `--only linksim`): it needs root or CAP_NET_ADMIN.
OPTIONAL = ("linksim",)
LINKSIM_OUTPUT = os.path.join(_ROOT, "benchmarks", "results", "linksim.json")
DEFAULT_OUTPUT = os.path.join(_ROOT, "benchmarks", "results", "results.json")
PLOT_NAME = "scaling_bandwidth.png"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description="keras_dist benchmarks against plain tf.distribute.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="smaller sizes and fewer rounds: < 5 minutes on 2 CPU cores")
    size.add_argument("--smoke", action="store_true",
                      help="minimal sizes (for tests); the timings mean nothing")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="PATH",
                        help="results JSON (default: benchmarks/results/results.json); "
                        f"the plot {PLOT_NAME} goes next to it")
    parser.add_argument("--only", default=None, metavar="NAME,...",
                        help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--markdown", default=None, metavar="RESULTS",
                        help="print the README markdown table of an existing results "
                        "file and exit")
    device = parser.add_argument_group("devices (overhead, communication)")
    device.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: one process on --replicas virtual GPUs (gpu.sh)")
    device.add_argument("--replicas", type=int, default=2, metavar="N",
                        help="virtual devices (overhead) / workers or devices "
                        "(communication); default 2")
    device.add_argument("--implementation", choices=("auto", "ring", "nccl"),
                        default="auto", help="all-reduce implementation for keras_dist")
    device.add_argument("--mixed-precision", action="store_true",
                        help="train with keras mixed_float16")
    link = parser.add_argument_group("link simulator (linksim; needs root or CAP_NET_ADMIN)")
    link.add_argument("--link-rate", default=None, metavar="RATE,...",
                      help="run linksim behind these per-worker link rates, e.g. "
                      "1gbit,10gbit (alone unless --only names more; output "
                      "benchmarks/results/linksim.json unless --output)")
    link.add_argument("--link-workers", default="2", metavar="N,...",
                      help="worker counts for linksim (default 2; 2,4 on a bigger machine)")
    return parser


def _selected(only: str | None, parser: argparse.ArgumentParser) -> list[str]:
    if not only:
        return list(BENCHMARKS)
    names = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCHMARKS + OPTIONAL]
    if unknown or not names:
        parser.error(f"--only: unknown benchmark(s) {unknown or only!r}; "
                     f"choose from {', '.join(BENCHMARKS + OPTIONAL)}")
    return names


def _device_options(args) -> dict:
    options = {"device_type": args.device.upper(), "replicas": args.replicas,
               "implementation": args.implementation,
               "mixed_precision": args.mixed_precision}
    return options


def _write(results: dict, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(results, file, indent=2, sort_keys=False, default=float)
    os.replace(temporary, path)


def _earlier(output: str, names: Sequence[str]) -> dict:
    """The other benchmarks' entries of an existing results file (`--only` keeps them).

    A run of some benchmarks updates their entries and leaves the rest as measured
    before; each entry carries its own `measured` (date, mode, load at start).
    """
    try:
        with open(output, encoding="utf-8") as file:
            earlier = json.load(file)
    except (OSError, ValueError):
        return {}
    if not isinstance(earlier, dict):
        return {}
    meta = earlier.get("meta", {})
    kept = {}
    for name, entry in earlier.items():
        if name == "meta" or name in names or not isinstance(entry, dict):
            continue
        entry.setdefault("measured", {"date": meta.get("date"), "mode": meta.get("mode"),
                                      "loadavg_start": meta.get("loadavg_start")})
        kept[name] = entry
    return kept


def run(names: Sequence[str], mode: str, output: str, *, device_options: dict | None = None,
        plot: bool = True, flags: str = "") -> dict:
    """Runs the benchmarks `names` in `mode`; writes and returns the results dict.

    A benchmark that fails is recorded as `{"error": traceback}` and the others still
    run; the caller decides the exit code.
    """
    from benchmarks import common, report

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    results: dict = {"meta": dict(common.machine_info(), mode=mode, flags=flags,
                                  benchmarks=list(names))}
    kept = _earlier(output, names)
    results.update(kept)
    started = time.perf_counter()
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        options = dict(device_options or {})
        link_options = options.pop("link", None) or {}
        if name == "linksim":
            options = link_options
        elif name == "buckets":  # the sweep is repeated behind each --link-rate
            options = {"link_rates": link_options.get("link_rates", [])}
        elif name not in _DEVICE_AWARE:
            options = {}
        elif name == "communication" and options.get("device_type") == "GPU":
            options["local"] = True  # NCCL cannot span processes sharing one GPU
        print(f"\n=== {name} ({mode}) ===", flush=True)
        began = time.perf_counter()
        try:
            results[name] = module.run(mode, **options)
            results[name]["elapsed_s"] = time.perf_counter() - began
            results[name]["measured"] = {"date": results["meta"]["date"], "mode": mode,
                                         "loadavg_start": results["meta"]["loadavg_start"]}
            module.report(results[name])
            if hasattr(module, "plot") and plot:
                try:  # a failed plot must not lose the measurements
                    figure = module.plot(results[name], os.path.join(
                        os.path.dirname(os.path.abspath(output)), module.PLOT_NAME))
                    results[name]["plot"] = os.path.basename(figure) if figure else None
                except Exception:  # noqa: BLE001
                    results[name]["plot_error"] = traceback.format_exc()
                    print(results[name]["plot_error"], file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - record it, run the rest, fail at the end
            text = traceback.format_exc()
            print(f"{name} failed:\n{text}", file=sys.stderr, flush=True)
            results[name] = {"error": text, "elapsed_s": time.perf_counter() - began}
        print(f"({name}: {results[name]['elapsed_s']:.0f} s)", flush=True)
        results["meta"]["elapsed_s"] = time.perf_counter() - started
        _write(results, output)
    meta = results["meta"]
    meta["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    meta["elapsed_s"] = time.perf_counter() - started
    if plot:
        figure = report.plot(results, os.path.join(os.path.dirname(os.path.abspath(output)),
                                                   PLOT_NAME))
        # Relative to the JSON, so a committed results folder does not name this machine.
        meta["plot"] = os.path.basename(figure) if figure else None
    _write(results, output)
    print(f"\nwrote {output}" + (f" and {meta['plot']} beside it" if meta.get("plot") else ""))
    print("\n" + report.markdown(results), flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.markdown:
        from benchmarks import report

        with open(args.markdown, encoding="utf-8") as file:
            print(report.markdown(json.load(file)))
        return 0
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    names = _selected(args.only, parser)
    device_options = _device_options(args)
    if args.link_rate:
        from keras_dist.planning import LinkSimulatorError, parse_rate

        rates = [rate.strip() for rate in args.link_rate.split(",") if rate.strip()]
        try:
            [parse_rate(rate) for rate in rates]
            counts = [int(n) for n in args.link_workers.split(",") if n.strip()]
        except ValueError as error:
            parser.error(f"--link-rate/--link-workers: {error}")
        if not rates or not counts or min(counts) < 2:
            parser.error("--link-rate needs >= 1 rate and --link-workers counts >= 2")
        device_options["link"] = {"link_rates": rates, "link_workers": counts}
        if not args.only:
            names = ["linksim"]
        if args.output == DEFAULT_OUTPUT and "linksim" in names:
            args.output = LINKSIM_OUTPUT
        try:
            from keras_dist.planning import Link, check_support

            check_support(Link.parse(rates[0], workers=min(counts)))
        except LinkSimulatorError as error:
            print(f"benchmarks/run.py --link-rate: {error}", file=sys.stderr)
            return 2
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    flags = " ".join(sys.argv[1:] if argv is None else argv)
    results = run(names, mode, args.output, device_options=device_options,
                  plot=not args.no_plot, flags=f" {flags}" if flags else "")
    failed = [name for name in names if "error" in results[name]]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
