"""`keras-dist plan`: the scaling model's predictions as a table (no TensorFlow)."""

from __future__ import annotations

import argparse
import json
import sys

from keras_dist.planning import model


def _params(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text.strip()[-1:].upper(), 1)
    number = text.strip()[:-1] if scale != 1 else text.strip()
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a parameter count such as 25000000, 25M or 1.3B, received {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 parameters, received {text!r}")
    return value


def _positive_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds such as 120, received {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 ms, received {text!r}")
    return value


def _non_negative_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds such as 2.5, received {text!r}")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 ms, received {text!r}")
    return value


def _rate(text: str) -> str:
    try:
        model.parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))
    return text


def _duration(text: str) -> str:
    try:
        model.parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))
    return text


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, received {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, received {value}")
    return value


def _overlap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], received {text!r}")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], received {text!r}")
    return value


def add_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--params", type=_params, required=True, metavar="P",
                      help="trainable parameters (25000000, 25M, 1.3B)")
    plan.add_argument("--step-ms", type=_positive_ms, required=True, metavar="T",
                      help="compute time of one step on one worker alone, ms")
    plan.add_argument("--link-rate", type=_rate, nargs="+", default=None, metavar="R",
                      help="each worker's link: 1gbit 10gbit ... (default: 1, 10, 25, "
                      "100gbit)")
    plan.add_argument("--workers", type=_workers, nargs="+", default=None, metavar="N",
                      help="worker counts (default: 2 4 8 ... 256)")
    plan.add_argument("--compression", choices=("none", "bf16"), nargs="+",
                      default=["none"], help="gradient compression (default: none)")
    plan.add_argument("--accumulation", type=_workers, nargs="+", default=[1], metavar="K",
                      help="micro-batches per all-reduce (default: 1)")
    plan.add_argument("--overlap", type=_overlap, default=0.0, metavar="O",
                      help="fraction of the compute that hides the all-reduce (0..1; "
                      "default 0: nothing hidden, as measured today)")
    plan.add_argument("--engine", default="ideal", metavar="ENGINE",
                      help="all-reduce engine: ideal (link-limited, NCCL-class; default), "
                      "measured (TensorFlow's gRPC ring on CPU, as fitted by "
                      "benchmarks/run.py --link-rate), or a JSON file")
    plan.add_argument("--link-latency", type=_duration, default="0us", metavar="L",
                      help="one-way link latency per ring step (e.g. 20us; default 0)")
    plan.add_argument("--overhead-ms", type=_non_negative_ms, default=0.0, metavar="H",
                      help="fixed cost per distributed step beyond compute and the "
                      "all-reduce, ms (default 0)")
    plan.add_argument("--json", action="store_true", help="print JSON rows instead")


def plan_main(args: argparse.Namespace) -> int:
    rates = args.link_rate or list(model.DEFAULT_LINK_RATES)
    workers = args.workers or list(model.DEFAULT_WORKERS)
    try:
        engine = model.load_engine(args.engine)
        rows = []
        for compression in args.compression:
            for accumulation in args.accumulation:
                rows += model.predict(args.params, args.step_ms, link_rate=rates,
                                      workers=workers, compression=compression,
                                      accumulation=accumulation, overlap=args.overlap,
                                      engine=engine, link_latency=args.link_latency,
                                      overhead_ms=args.overhead_ms)
    except ValueError as error:
        print(f"keras-dist plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
        return 0
    print(f"keras-dist plan: {args.params:,.0f} params, {args.step_ms:g} ms compute per "
          f"step on one worker, overlap {args.overlap:g}, overhead {args.overhead_ms:g} ms "
          f"per step; engine {engine.name} "
          f"(alpha {engine.alpha_s * 1e6:.1f} us/step, "
          f"{engine.beta_s_per_byte * 1e9:.3f} ns/byte beyond the link; {engine.source})")
    print("ring all-reduce t = 2(N-1)(alpha+latency) + 2(N-1)/N * bytes * (beta + 8/rate); "
          "step = k*(T+overhead) + t - min(t, overlap*T), per micro-batch; efficiency = T / step")
    for line in model.table_lines(rows):
        print(line)
    return 0
