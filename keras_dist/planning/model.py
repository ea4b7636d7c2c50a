"""The alpha-beta model of a ring all-reduce, its fit, and step-time predictions.

A ring all-reduce of `B` bytes on `N` workers takes `2(N-1)` steps; in each, every worker
sends and receives `B/N` bytes. With a per-step latency `alpha` (seconds) and a per-byte
cost `beta` (seconds per byte each worker puts on its link):

    t(N, B) = 2(N-1) * alpha + 2(N-1)/N * B * beta

`beta` has two parts: the link, `8 / rate` (rate in bit/s of one worker's link), and the
engine that moves the bytes (serialisation, copies, the reduction; TensorFlow's gRPC ring
on CPU is measured at about 0.3 GB/s here, NCCL on GPUs is close to the link):

    beta = beta_engine + 8 / rate          ("sum": the engine and the wire take turns)

A training step of compute time `T` (one worker alone, per micro-batch) then takes, per
optimizer step with `k` accumulated micro-batches and an overlap factor `o` (the fraction
of the compute that can hide communication; 0 = nothing hidden, as measured today):

    step_k = k*(T + h) + t - min(t, o*T)    efficiency = k*T / step_k

with `h` a fixed cost per distributed step beyond compute and the all-reduce (0 unless
measured: `benchmarks/linksim.py` calibrates `h` and `o` on the unlimited loopback).

Everything here is plain Python (no TensorFlow): `keras-dist plan` is instant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Iterable, Sequence

__all__ = [
    "DEFAULT_LINK_RATES", "DEFAULT_WORKERS", "ENGINES", "Engine", "Prediction",
    "allreduce_time", "fit_alpha_beta", "format_rate", "load_engine", "parse_duration",
    "parse_rate", "predict", "table_lines",
]

DEFAULT_WORKERS = (2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_LINK_RATES = ("1gbit", "10gbit", "25gbit", "100gbit")
COMPRESSIONS = {"none": 4, "fp32": 4, "bf16": 2, "fp16": 2}

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"

# The measured engine figures written by `python benchmarks/run.py --link-rate ...`.
MEASURED_ENGINE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "measured_engine.json")


def parse_rate(text) -> float:
    """A link rate such as "10gbit", "100mbit" or "1.5Gbit" in bit/s (tc's units).

    Raises:
        ValueError: not a positive number followed by bit, kbit, mbit, gbit or tbit.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"A link rate must be > 0 bit/s, received {text!r}")
        return value
    match = re.fullmatch(_NUMBER + r"([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _RATE_UNITS:
        raise ValueError(
            f"Unknown link rate {text!r}: expected a number with a unit of "
            f"{', '.join(_RATE_UNITS)} (bits per second, as tc writes them), e.g. "
            "'10gbit' or '100mbit'")
    value = float(match.group(1)) * _RATE_UNITS[unit]
    if not value > 0:
        raise ValueError(f"A link rate must be > 0 bit/s, received {text!r}")
    return value


def parse_duration(text) -> float:
    """A duration such as "50us", "1ms" or "0" in seconds.

    Raises:
        ValueError: not a non-negative number followed by s, ms, us or ns.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(_NUMBER + r"([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or (unit not in _TIME_UNITS and not (unit == "" and
                                                           float(match.group(1)) == 0)):
            raise ValueError(f"Unknown duration {text!r}: expected a number with a unit "
                             f"of {', '.join(_TIME_UNITS)}, e.g. '50us' or '1ms'")
        value = float(match.group(1)) * _TIME_UNITS.get(unit, 1.0)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"A duration must be >= 0, received {text!r}")
    return value


def format_rate(bits_per_second: float | None) -> str:
    if bits_per_second is None:
        return "loopback"
    for unit, scale in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second:g} bit"


def allreduce_time(nbytes: float, workers: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-reduce of `nbytes` on `workers`: 2(N-1)a + 2(N-1)/N B b."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) * alpha + 2 * (workers - 1) / workers * nbytes * beta


@dataclasses.dataclass(frozen=True)
class Engine:
    """An all-reduce engine: per-ring-step latency and per-byte cost beyond the link.

    Attributes:
        name: What it stands for ("ideal", "tf-grpc-cpu", ...).
        alpha_s: Seconds per ring step (software latency; the link's latency is added).
        beta_s_per_byte: Seconds per byte each worker sends, beyond the link's 8/rate.
        source: Where the figures come from (a measurement, an assumption).
    """

    name: str
    alpha_s: float
    beta_s_per_byte: float
    source: str = ""

    def beta(self, rate_bps: float | None) -> float:
        """The total per-byte cost on a link of `rate_bps` (None: the engine alone)."""
        return self.beta_s_per_byte + (8.0 / rate_bps if rate_bps else 0.0)

    def time(self, nbytes: float, workers: int, rate_bps: float | None,
             latency_s: float = 0.0) -> float:
        return allreduce_time(nbytes, workers, self.alpha_s + latency_s, self.beta(rate_bps))


# NCCL-class engines move bytes at close to the link rate; what is left is latency.
IDEAL = Engine("ideal", 5e-6, 0.0,
               "assumed: link-limited transfer (NCCL-class), 5 us per ring step")
ENGINES = ("ideal", "measured")


def load_engine(engine="ideal") -> Engine:
    """`Engine` from a name ("ideal", "measured"), a JSON path, a dict or an Engine.

    "measured" is TensorFlow's gRPC ring on CPU as fitted by `python benchmarks/run.py
    --link-rate ...` on the machine that last wrote `measured_engine.json`.
    """
    if isinstance(engine, Engine):
        return engine
    if isinstance(engine, dict):
        try:
            return Engine(str(engine.get("name", "custom")), float(engine["alpha_s"]),
                          float(engine["beta_s_per_byte"]), str(engine.get("source", "")))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"An engine dict needs numbers 'alpha_s' and "
                             f"'beta_s_per_byte'; received {engine!r} ({error})") from None
    if engine == "ideal":
        return IDEAL
    path = MEASURED_ENGINE_FILE if engine == "measured" else str(engine)
    if not os.path.exists(path):
        if engine == "measured":
            raise ValueError("No measured engine figures yet: run `python benchmarks/run.py "
                             "--link-rate 1gbit,10gbit --quick` (writes "
                             f"{MEASURED_ENGINE_FILE})")
        raise ValueError(f"Unknown engine {engine!r}: expected one of {list(ENGINES)} or "
                         "the path of a JSON file with 'alpha_s' and 'beta_s_per_byte'")
    with open(path, encoding="utf-8") as file:
        data = json.load(file)
    return load_engine(data.get("engine", data))


def fit_alpha_beta(samples: Iterable[Sequence[float]]) -> tuple[float, float, float]:
    """Least-squares `alpha`, `beta` from (workers, bytes, seconds) samples.

    The residuals are relative (each row divided by its time), so 1 KB and 64 MB
    all-reduces weigh the same; both parameters are kept >= 0.

    Returns:
        (alpha_s, beta_s_per_byte, max relative error of the fit over the samples).

    Raises:
        ValueError: fewer than 2 samples, or no two distinct sizes.
    """
    rows = [(int(n), float(b), float(t)) for n, b, t in samples]
    rows = [row for row in rows if row[0] > 1]
    if len(rows) < 2 or len({(n, b) for n, b, _ in rows}) < 2:
        raise ValueError("fit_alpha_beta needs >= 2 samples (workers > 1) of distinct "
                         f"sizes; received {len(rows)}")
    if any(t <= 0 or b < 0 for _, b, t in rows):
        raise ValueError("fit_alpha_beta: times must be > 0 and bytes >= 0")
    # Features of t: x1 = 2(N-1) (alpha), x2 = 2(N-1)/N * B (beta); weights 1/t.
    xs = [(2 * (n - 1) / t, 2 * (n - 1) / n * b / t) for n, b, t in rows]
    s11 = sum(a * a for a, _ in xs)
    s12 = sum(a * c for a, c in xs)
    s22 = sum(c * c for _, c in xs)
    r1 = sum(a for a, _ in xs)  # target: t / t = 1
    r2 = sum(c for _, c in xs)
    det = s11 * s22 - s12 * s12
    alpha = beta = -1.0
    if det > 0:
        alpha = (r1 * s22 - r2 * s12) / det
        beta = (s11 * r2 - s12 * r1) / det
    if alpha < 0 or beta < 0 or det <= 0:
        # One parameter at its bound: fit the other alone, keep the better of the two.
        only_alpha = (r1 / s11, 0.0)
        only_beta = (0.0, r2 / s22)
        alpha, beta = min((only_alpha, only_beta),
                          key=lambda p: _max_rel_error(rows, *p))
    return alpha, beta, _max_rel_error(rows, alpha, beta)


def _max_rel_error(rows, alpha, beta) -> float:
    return max(abs(allreduce_time(b, n, alpha, beta) - t) / t for n, b, t in rows)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One row of `predict`: the step of one worker among `workers`."""

    workers: int
    link_rate_bps: float
    compression: str
    accumulation: int
    overlap: float
    compute_ms: float       # one micro-batch on one worker
    allreduce_ms: float     # one gradient all-reduce
    step_ms: float          # per micro-batch (an optimizer step / accumulation)
    efficiency: float       # compute_ms / step_ms (weak scaling, per-worker batch fixed)
    speedup: float          # workers * efficiency: throughput against one worker

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def predict(params: float, step_ms: float, *, link_rate="10gbit",
            workers: Sequence[int] = DEFAULT_WORKERS, compression: str = "none",
            accumulation: int = 1, overlap: float = 0.0, engine="ideal",
            link_latency="0us", overhead_ms: float = 0.0) -> list[Prediction]:
    """Predicted step time and scaling efficiency of data-parallel training.

    Args:
        params: Trainable parameters (the gradient is `params` floats).
        step_ms: Compute time of one training step on one worker alone (ms), at the
            per-worker batch you will use.
        link_rate: Each worker's link ("25gbit", or bit/s), or a list of them.
        workers: Worker counts to predict.
        compression: "none"/"fp32" (4 bytes per value) or "bf16"/"fp16" (2), as in
            `GradientAggregation(compression=...)`.
        accumulation: Micro-batches per all-reduce (`GradientAggregation(
            accumulation_steps=k)`).
        overlap: Fraction of a micro-batch's compute that can hide the all-reduce
            (0..1; 0 = strictly after the backward pass, as measured today).
        engine: "ideal", "measured", a JSON path, a dict or an `Engine` (see
            `load_engine`).
        link_latency: One-way latency added to each ring step ("50us").
        overhead_ms: Fixed cost of each distributed step beyond compute and the
            all-reduce (ms, >= 0), e.g. as `benchmarks/linksim.py` measures it.

    Returns:
        One `Prediction` per (link rate, worker count), in that order.

    Raises:
        ValueError: a bad argument; the message names it.

    Example:
        >>> rows = predict(25_000_000, 120.0, link_rate="25gbit", workers=[64])
        >>> round(rows[0].efficiency, 2) > 0
        True
    """
    params = _positive("params", params)
    compute_s = _positive("step_ms", step_ms) / 1000
    if compression not in COMPRESSIONS:
        raise ValueError(f"Unknown compression {compression!r}; expected one of "
                         f"{sorted(COMPRESSIONS)}")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be an integer >= 1, received {accumulation!r}")
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or \
            not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be a number in [0, 1], received {overlap!r}")
    if isinstance(overhead_ms, bool) or not isinstance(overhead_ms, (int, float)) or \
            not math.isfinite(overhead_ms) or overhead_ms < 0:
        raise ValueError(f"overhead_ms must be a number >= 0, received {overhead_ms!r}")
    counts = [workers] if isinstance(workers, int) else list(workers)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                         for n in counts):
        raise ValueError(f"workers must be integers >= 1, received {workers!r}")
    rates = link_rate if isinstance(link_rate, (list, tuple)) else [link_rate]
    rates = [parse_rate(rate) for rate in rates]
    latency = parse_duration(link_latency)
    model = load_engine(engine)
    nbytes = params * COMPRESSIONS[compression]
    rows = []
    for rate in rates:
        for n in counts:
            comm = model.time(nbytes, n, rate, latency)
            overhead = overhead_ms / 1000 if n > 1 else 0.0
            step = accumulation * (compute_s + overhead) + comm - min(comm, overlap * compute_s)
            efficiency = accumulation * compute_s / step
            rows.append(Prediction(n, rate, compression, accumulation, float(overlap),
                                   1000 * compute_s, 1000 * comm, 1000 * step / accumulation,
                                   efficiency, n * efficiency))
    return rows


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number > 0, received {value!r}")
    return float(value)


def table_lines(rows: Sequence[Prediction]) -> list[str]:
    """The predictions as a text table (one line per row)."""
    header = (f"{'link':>10} {'workers':>7} {'compress':>8} {'accum':>5} "
              f"{'all-reduce ms':>13} {'step ms':>9} {'efficiency':>10} {'speedup':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{format_rate(row.link_rate_bps):>10} {row.workers:>7} "
                     f"{row.compression:>8} {row.accumulation:>5} {row.allreduce_ms:>13.2f} "
                     f"{row.step_ms:>9.2f} {row.efficiency:>10.2f} {row.speedup:>8.1f}")
    return lines
