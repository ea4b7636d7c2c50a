"""engine: where TensorFlow's all-reduce engine is the limit, against a numpy + socket ring.

On 2 processes on this machine's loopback (127.0.0.1), for each size:

1. **reference ring**: a ring all-reduce written with numpy and plain TCP sockets
   (reduce-scatter, then all-gather; one sender thread per process, `recv_into` a
   preallocated buffer, `np.add` in place): what the wire, the kernel and memory allow;
2. **TensorFlow**: `ReplicaContext.all_reduce(SUM)` of one float32 tensor under
   `MultiWorkerMirroredStrategy` on 2 launched workers (RING collectives over gRPC, the
   engine every keras_dist multi-worker job on CPU uses), wall and CPU time;
3. **profile** (when `perf` is installed and allowed): worker 0 samples itself with
   `perf record` during the largest TensorFlow all-reduce, and the samples are put in
   buckets by the function they were taken in: memory copies, the kernel's TCP/loopback
   path, gRPC and protobuf, the reduction arithmetic, thread wake-ups and locks, other.
   Together with the wall / CPU ratio (time spent waiting) this says where the gap goes.

Both sides use the same bytes and the same bus factor (2(n-1)/n), so `gap = TF time /
reference time`. The remedies that exist are listed in the results next to the figures.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

from benchmarks import common

NAME = "engine"

REMEDIES = (
    "GPUs: implementation='nccl' (NCCL moves GPU buffers without gRPC or protobuf copies)",
    "fewer bytes: GradientAggregation(compression='bf16') halves them",
    "fewer rounds: GradientAggregation(accumulation_steps=k) all-reduces once per k steps",
    "hide it: keras_dist's bucketed all-reduce overlaps the engine's time with the "
    "backward pass (benchmarks/scaling.py, overlap efficiency)",
)

# Where a sample was taken -> bucket (first match wins; matched on "dso symbol").
_BUCKETS = (
    ("memory copies", r"memcpy|memmove|__memcpy|copy_user|copyout|copyin|_copy_to_iter|"
                      r"_copy_from_iter|rep_movs|clear_page|memset"),
    ("reduction arithmetic", r"Eigen|Add[A-Z<]|scalar_sum|AddN|ComputeBinaryOp|"
                             r"CollectiveAdapter|ReduceOp|BinaryOp"),
    ("gRPC and protobuf", r"grpc|protobuf|proto2|Proto|ByteBuffer|absl.*Cord|"
                          r"Serialize|Parse|Recv(Buf|Tensor)|tensorflow::.*Rpc"),
    ("kernel TCP / loopback", r"kernel\.kallsyms.*(tcp|ip_|skb|sock|net_rx|__netif|"
                              r"loopback|inet|sk_|__dev_queue|napi|process_backlog)"),
    ("wake-ups, locks, scheduling", r"futex|mutex|Mutex|CondVar|condition_variable|"
                                    r"schedule|pthread_cond|epoll|poll|__lock|spin|"
                                    r"try_to_wake|finish_task_switch|sem_"),
    ("memory allocation", r"malloc|free|alloc|tcmalloc|_int_free|mmap|munmap|page_fault|"
                          r"exc_page_fault|do_anonymous_page"),
)


def settings(mode: str) -> dict:
    mb = 1 << 20
    return dict(
        sizes=common.pick(mode, smoke=[64 << 10], quick=[mb, 4 * mb, 16 * mb],
                          full=[mb, 4 * mb, 16 * mb, 64 * mb]),
        budget_bytes=common.pick(mode, smoke=1 * mb, quick=128 * mb, full=512 * mb),
        profile_seconds=common.pick(mode, smoke=0.0, quick=4.0, full=8.0),
        threads=1,  # TensorFlow thread pools, as in `scaling`
    )


# -- the reference: numpy + sockets --------------------------------------------------------
def _listen():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server


def _ring_worker(rank, workers, ports, ready, sizes, budget_bytes, results):
    """One process of the reference ring: connect, then time each size."""
    import numpy as np

    server = _listen()
    ports[rank] = server.getsockname()[1]
    ready.wait()
    right = socket.create_connection(("127.0.0.1", ports[(rank + 1) % workers]))
    left, _ = server.accept()
    for sock in (left, right):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
    rows = []
    for size in sizes:
        data = np.zeros(size // 4, np.float32)  # sums stay finite however often
        scratch = np.empty_like(data)
        count = max(3, min(200, budget_bytes // size))
        _ring_all_reduce(data, scratch, rank, workers, left, right)  # warm up
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(count):
            _ring_all_reduce(data, scratch, rank, workers, left, right)
        rows.append({"size_bytes": size,
                     "time_s": (time.perf_counter() - start) / count,
                     "cpu_s": (time.process_time() - cpu) / count})
    results.put((rank, rows))
    left.close(), right.close(), server.close()


def _ring_all_reduce(data, scratch, rank, workers, left, right):
    """In place: reduce-scatter then all-gather over `workers` chunks."""
    import numpy as np

    chunks = np.array_split(np.arange(data.size), workers)
    bounds = [(int(c[0]), int(c[-1]) + 1) if c.size else (0, 0) for c in chunks]

    def exchange(send_index, receive_index, reduce):
        lo, hi = bounds[send_index]
        sender = threading.Thread(target=right.sendall,
                                  args=(memoryview(data[lo:hi]).cast("B"),))
        sender.start()
        rlo, rhi = bounds[receive_index]
        view = memoryview(scratch[rlo:rhi]).cast("B")
        received = 0
        while received < view.nbytes:
            received += left.recv_into(view[received:])
        sender.join()
        if reduce:
            np.add(data[rlo:rhi], scratch[rlo:rhi], out=data[rlo:rhi])
        else:
            data[rlo:rhi] = scratch[rlo:rhi]

    for step in range(workers - 1):  # reduce-scatter
        exchange((rank - step) % workers, (rank - step - 1) % workers, True)
    for step in range(workers - 1):  # all-gather
        exchange((rank - step + 1) % workers, (rank - step) % workers, False)


def reference_ring(sizes, workers: int = 2, budget_bytes: int = 128 << 20) -> list[dict]:
    """Times the numpy + socket ring all-reduce on `workers` processes (slowest rank)."""
    context = multiprocessing.get_context("fork")  # numpy only; no TensorFlow here
    with context.Manager() as manager:
        ports = manager.dict()
        ready = context.Event()
        results = context.Queue()
        processes = [context.Process(target=_ring_worker, daemon=True,
                                     args=(rank, workers, ports, ready, list(sizes),
                                           budget_bytes, results))
                     for rank in range(workers)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + 60
        while len(ports) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError("engine: the reference ring's processes did not start")
            time.sleep(0.01)
        ready.set()
        by_rank = dict(results.get(timeout=common.WORKER_TIMEOUT) for _ in processes)
        for process in processes:
            process.join(timeout=30)
    return [max(rows, key=lambda row: row["time_s"]) for rows in zip(*by_rank.values())]


# -- TensorFlow, with a profile --------------------------------------------------------------
def measure_tf(config: dict) -> dict:
    """One launched worker: time each size; worker 0 also profiles the largest one."""
    common.pin_threads(config["threads"], config["threads"])
    import tensorflow as tf

    import keras_dist
    from keras_dist.planning import bench as _bench

    tf.get_logger().setLevel("ERROR")
    strategy = keras_dist.strategy()
    rows = []
    for size in config["sizes"]:
        wall, cpu = _bench.time_all_reduce(strategy, [size // 4], "plain_fp32",
                                           budget_bytes=config["budget_bytes"],
                                           with_cpu=True)
        rows.append({"size_bytes": size, "time_s": wall, "cpu_s": cpu})
    profile = None
    if config["profile_seconds"] > 0:
        profile = _profiled(strategy, config["sizes"][-1], config["profile_seconds"],
                            record=keras_dist.worker_index() == 0)
    # Leave together: a worker that exits while its peer still reads the profile makes
    # the peer's coordination service log the exit as a crash.
    keras_dist.barrier("engine-done")
    return {"rows": rows, "profile": profile}


def _profiled(strategy, size: int, seconds: float, record: bool) -> dict | None:
    """All-reduces `size` bytes for about `seconds`; with `record`, under `perf record`."""
    from keras_dist.planning import bench as _bench

    wall, _ = _bench.time_all_reduce(strategy, [size // 4], "plain_fp32",
                                     budget_bytes=size * 3, with_cpu=True)
    # The same number of all-reduces on every worker (each waits for the others).
    budget = int(size * max(3, round(seconds / max(wall, 1e-6))))
    recorder, path = (_start_perf() if record else (None, None))
    if record and recorder is None:
        _bench.time_all_reduce(strategy, [size // 4], "plain_fp32", budget_bytes=budget)
        return {"available": False,
                "reason": "perf is not installed or not allowed (perf_event_paranoid)"}
    _bench.time_all_reduce(strategy, [size // 4], "plain_fp32", budget_bytes=budget)
    if recorder is None:
        return None
    return _stop_perf(recorder, path, size)


def _start_perf():
    perf = shutil.which("perf")
    if perf is None:
        return None, None
    path = os.path.join(tempfile.mkdtemp(prefix="keras_dist_perf_"), "perf.data")
    recorder = subprocess.Popen(
        [perf, "record", "-F", "997", "-p", str(os.getpid()), "-o", path],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)
    if recorder.poll() is not None:
        return None, None
    return recorder, path


def _stop_perf(recorder, path: str, size: int) -> dict:
    recorder.send_signal(signal.SIGINT)
    try:
        recorder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        recorder.kill()
    report = subprocess.run(
        ["perf", "report", "-i", path, "--stdio", "--no-children", "--sort", "dso,sym",
         "--percent-limit", "0"], capture_output=True, text=True, timeout=300)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return dict(categorize(report.stdout), available=True, size_bytes=size)


def categorize(report_text: str) -> dict:
    """`perf report --sort dso,sym` text -> % of samples per bucket, and the top symbols."""
    buckets = {name: 0.0 for name, _ in _BUCKETS}
    buckets["other"] = 0.0
    top = []
    for line in report_text.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+(\S+)\s+(.*)$", line)
        if not match or line.lstrip().startswith("#"):
            continue
        percent, dso = float(match.group(1)), match.group(2)
        symbol = re.sub(r"^\[[.kgu]\]\s*", "", match.group(3).strip())
        text = f"{dso} {symbol}"
        name = next((bucket for bucket, pattern in _BUCKETS if re.search(pattern, text)),
                    "other")
        buckets[name] += percent
        if len(top) < 12:
            top.append({"percent": percent, "dso": os.path.basename(dso),
                        "symbol": symbol[:120]})
    return {"buckets_percent": buckets, "top_symbols": top}


def run(mode: str) -> dict:
    config = settings(mode)
    reference = reference_ring(config["sizes"], 2, config["budget_bytes"])
    workers = common.run_workers(measure_tf, 2, kwargs={"config": config})
    tf_rows = [max(rows, key=lambda row: row["time_s"])
               for rows in zip(*(w["rows"] for w in workers))]
    factor = 1.0  # 2(n-1)/n for n = 2
    rows = []
    for ref, ours in zip(reference, tf_rows):
        size = ref["size_bytes"]
        rows.append({
            "size_bytes": size,
            "reference_ms": 1000 * ref["time_s"], "tensorflow_ms": 1000 * ours["time_s"],
            "reference_busbw_GBps": factor * size / ref["time_s"] / 1e9,
            "tensorflow_busbw_GBps": factor * size / ours["time_s"] / 1e9,
            "reference_cpu_ms": 1000 * ref["cpu_s"], "tensorflow_cpu_ms": 1000 * ours["cpu_s"],
            "gap": ours["time_s"] / ref["time_s"],
            "tensorflow_busy_fraction": ours["cpu_s"] / ours["time_s"],
        })
    profile = next((w["profile"] for w in workers if w.get("profile")), None)
    return {"workers": 2, "rows": rows, "gap_largest": rows[-1]["gap"],
            "profile": profile, "remedies": list(REMEDIES), "config": config}


def report(result: dict) -> None:
    common.print_table(
        "engine: one float32 all-reduce on 2 workers over loopback, numpy + socket ring "
        "vs TensorFlow (MultiWorkerMirroredStrategy, RING over gRPC); cpu = process CPU "
        "time per all-reduce",
        ["size", "ref ms", "TF ms", "ref GB/s", "TF GB/s", "ref cpu ms", "TF cpu ms", "gap"],
        [(common.format_bytes(r["size_bytes"]), r["reference_ms"], r["tensorflow_ms"],
          r["reference_busbw_GBps"], r["tensorflow_busbw_GBps"], r["reference_cpu_ms"],
          r["tensorflow_cpu_ms"], r["gap"]) for r in result["rows"]],
    )
    profile = result.get("profile")
    if profile and profile.get("available"):
        parts = ", ".join(f"{name} {share:.0f}%" for name, share in
                          sorted(profile["buckets_percent"].items(), key=lambda kv: -kv[1]))
        print(f"where TensorFlow's CPU time goes ({common.format_bytes(profile['size_bytes'])}"
              f", perf samples of worker 0): {parts}", flush=True)
    elif profile:
        print(f"profile: {profile.get('reason')}", flush=True)
    print("remedies: " + "; ".join(result["remedies"]), flush=True)
