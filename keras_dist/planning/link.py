"""The link simulator: local workers behind a rate-limited loopback.

`run_in_link(fn, link)` runs `fn` in a fresh Python process inside a private network
namespace (`unshare -n`) whose only interface, `lo` (127.0.0.1), has a token bucket
(`tc qdisc ... tbf`) and, with a latency, `netem` in front of it. Everything `fn` starts
(e.g. `keras_dist.testing.run_on_workers`) lives in that namespace, so the workers talk
over 127.0.0.1 through the limited link; no other address is ever used, and the machine's
own network is untouched. The namespace disappears with the process.

One qdisc carries every worker's traffic on loopback (both directions, all N workers),
whereas on a real network each worker has its own full-duplex link. To simulate N workers
that each have a link of `rate`, the qdisc is set to `N x rate`: a ring all-reduce keeps
all N links busy at once, so the aggregate through the one qdisc is N times one link.

Needs root or CAP_NET_ADMIN (or unprivileged user namespaces, tried as `unshare -r -n`),
and the `unshare`, `ip` and `tc` programs; `check_support` says clearly what is missing.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping

from keras_dist.launching import zygote
from keras_dist.planning.model import format_rate, parse_duration, parse_rate

__all__ = ["Link", "LinkSimulatorError", "check_support", "measure_link", "run_in_link"]

_CAP_NET_ADMIN = 12


class LinkSimulatorError(RuntimeError):
    """The link simulator cannot run here (privileges, tools, kernel qdiscs)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """A simulated network: `workers` workers, each on a link of `rate` and `latency`.

    Attributes:
        rate_bps: Each worker's link rate in bit/s; None leaves loopback unlimited (still
            a private namespace).
        latency_s: One-way latency added to every packet (netem), seconds.
        workers: Workers sharing the loopback qdisc (it is set to workers x rate).
    """

    rate_bps: float | None
    latency_s: float = 0.0
    workers: int = 2

    @classmethod
    def parse(cls, rate=None, latency=None, workers: int = 2) -> "Link":
        """From command-line text: rate "10gbit" (None/"loopback": unlimited), "50us"."""
        rate_bps = None if rate in (None, "", "loopback", "unlimited") else parse_rate(rate)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, received {workers!r}")
        return cls(rate_bps, parse_duration(latency or 0), workers)

    @property
    def qdisc_rate_bps(self) -> float | None:
        return None if self.rate_bps is None else self.rate_bps * max(1, self.workers)

    def describe(self) -> str:
        text = (f"{format_rate(self.rate_bps)} per worker" if self.rate_bps is not None
                else "unlimited loopback") + f", {self.workers} workers"
        if self.rate_bps is not None:
            text += f" (loopback qdisc {format_rate(self.qdisc_rate_bps)} for {self.workers})"
        if self.latency_s:
            text += f", +{self.latency_s * 1e6:g} us latency"
        return text

    def setup_commands(self) -> list[list[str]]:
        """The `ip`/`tc` commands that make the namespace's loopback this link."""
        commands = [["ip", "link", "set", "lo", "up"]]
        parent = ["root"]
        if self.latency_s:
            commands.append(["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:",
                             "netem", "delay", f"{self.latency_s * 1e6:.0f}us"])
            parent = ["parent", "1:1"]
        if self.rate_bps is not None:
            rate = int(self.qdisc_rate_bps)
            # The bucket must hold a 64 KiB loopback packet; about 2 ms of traffic keeps
            # tbf accurate at high rates without letting bursts dominate.
            burst = max(256 << 10, rate // 8 // 500)
            commands.append(["tc", "qdisc", "add", "dev", "lo", *parent, "handle", "10:",
                             "tbf", "rate", f"{rate}bit", "burst", str(burst),
                             "latency", "100ms"])
        return commands

    def shell(self) -> str:
        return " && ".join(shlex.join(command) for command in self.setup_commands())


_PREFIX_CACHE: dict[tuple, list[str]] = {}


def _has_cap_net_admin() -> bool:
    try:
        with open("/proc/self/status", encoding="utf-8") as file:
            for line in file:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return hasattr(os, "geteuid") and os.geteuid() == 0


def check_support(link: Link | None = None) -> list[str]:
    """The `unshare` prefix that can build `link` here, or a clear `LinkSimulatorError`.

    Runs the link's setup once in a throw-away namespace (tens of milliseconds).
    """
    link = link or Link(1e9)
    key = (link.latency_s > 0, link.rate_bps is not None)
    if key in _PREFIX_CACHE:
        return _PREFIX_CACHE[key]
    if not sys.platform.startswith("linux"):
        raise LinkSimulatorError("The link simulator needs Linux network namespaces and tc; "
                                 f"this is {sys.platform}.")
    missing = [tool for tool in ("unshare", "ip", "tc") if not shutil.which(tool)]
    if missing:
        raise LinkSimulatorError(
            f"The link simulator needs the programs {', '.join(missing)} (util-linux "
            "and iproute2: e.g. `apt-get install util-linux iproute2`), not found on PATH.")
    prefixes = [["unshare", "-n"]]
    if not _has_cap_net_admin():
        prefixes.append(["unshare", "-r", "-n"])  # unprivileged user namespace
    failures = []
    for prefix in prefixes:
        done = subprocess.run([*prefix, "sh", "-c", link.shell()], capture_output=True,
                              text=True, timeout=60)
        if done.returncode == 0:
            _PREFIX_CACHE[key] = prefix
            return prefix
        failures.append(f"`{shlex.join(prefix)} sh -c {shlex.quote(link.shell())}`: "
                        f"{(done.stderr or done.stdout).strip() or f'exit {done.returncode}'}")
    detail = "; ".join(failures)
    if link.latency_s and "unknown" in detail.lower():
        raise LinkSimulatorError(
            "--link-latency needs the netem qdisc (kernel module sch_netem), which this "
            f"kernel does not provide ({detail}). Leave the latency out (rate only), or "
            "run on a kernel with sch_netem.")
    if not _has_cap_net_admin():
        raise LinkSimulatorError(
            "The link simulator needs root or CAP_NET_ADMIN to create a private network "
            "namespace and rate-limit its loopback with tc (unprivileged user namespaces "
            f"did not work either: {detail}). Run it as root (e.g. `sudo -E keras-dist "
            "bench allreduce --link-rate 10gbit`), grant the capability (`sudo setcap "
            "cap_net_admin,cap_sys_admin+ep $(which unshare)`), or run without "
            "--link-rate.")
    raise LinkSimulatorError(f"The link simulator could not set up the namespace: {detail}")


def run_in_link(fn: Callable[..., Any], link: Link, *, kwargs: Mapping[str, Any] | None = None,
                timeout: float = 1800, env: Mapping[str, str] | None = None) -> Any:
    """Calls `fn(**kwargs)` in a fresh Python process behind `link`; returns its value.

    `fn` travels by cloudpickle (module-level functions by name); its value comes back
    the same way. The process's stdout and stderr pass through.

    Raises:
        LinkSimulatorError: the namespace cannot be built here, or `fn` raised (the
            message holds its traceback).
        TimeoutError: `fn` did not finish within `timeout` seconds.
    """
    import cloudpickle

    prefix = check_support(link)
    with tempfile.TemporaryDirectory(prefix="keras_dist_link_") as directory:
        payload = os.path.join(directory, "call.pkl")
        result = os.path.join(directory, "result.pkl")
        with open(payload, "wb") as file:
            cloudpickle.dump((fn, dict(kwargs or {})), file)
        script = f'{link.shell()} && exec "$@"'
        command = [*prefix, "sh", "-c", script, "sh", sys.executable, "-m",
                   "keras_dist.planning._inside", payload, result]
        environment = dict(os.environ)
        environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        path = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        if environment.get("PYTHONPATH"):
            path.append(environment["PYTHONPATH"])
        environment["PYTHONPATH"] = os.pathsep.join(path + [p for p in sys.path if p])
        environment.update(env or {})
        process = subprocess.Popen(command, env=environment, start_new_session=True)
        code, namespace = _wait_noting_namespace(process, timeout)
        # Whatever is still alive in the namespace (a launched worker that left the
        # process group, e.g. one stuck in a collective after its peer failed) is killed
        # too: nothing started behind the link outlives the call.
        _kill_namespace(namespace, process)
        if code is None:
            raise TimeoutError(f"run_in_link: {getattr(fn, '__name__', fn)} did not finish "
                               f"within {timeout} s behind {link.describe()}")
        if not os.path.exists(result):
            raise LinkSimulatorError(f"run_in_link: the process behind {link.describe()} "
                                     f"exited with {code} and no result")
        with open(result, "rb") as file:
            ok, value = cloudpickle.load(file)
    if not ok:
        raise LinkSimulatorError(f"{getattr(fn, '__name__', fn)} failed behind "
                                 f"{link.describe()}:\n{value}")
    return value


def _net_namespace(pid) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _wait_noting_namespace(process, timeout: float):
    """Waits for `process`; returns (exit code or None on timeout, its net namespace).

    The namespace is read once the process has entered it (it starts in ours and
    `unshare` moves it), so it is known even if the process exits quickly afterwards.
    """
    own = _net_namespace("self")
    namespace = None
    deadline = time.monotonic() + timeout
    while True:
        current = _net_namespace(process.pid)
        if current is not None and current != own:
            namespace = current
        try:
            return process.wait(timeout=0.05 if namespace is None else 0.5), namespace
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                return None, namespace


def _kill_namespace(namespace: str | None, process) -> None:
    """SIGKILLs `process`'s group and every process left in `namespace` (never ours)."""
    try:
        os.killpg(process.pid, 9)
    except OSError:
        pass
    killed = []
    if namespace is not None and namespace != _net_namespace("self"):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _net_namespace(entry) == namespace:
                try:
                    os.kill(int(entry), 9)
                    killed.append(int(entry))
                except OSError:
                    pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    # SIGKILL is delivered asynchronously: wait until each process has exited (gone or a
    # zombie left to its new parent), so none of them is still running when we return.
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if zygote.running(pid)]
        if killed:
            time.sleep(0.02)


def _ring_transfer(workers: int, nbytes: int) -> float:
    """Seconds for `workers` threads in a TCP ring on 127.0.0.1 to each send `nbytes`."""
    import socket

    listeners = []
    for _ in range(workers):
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        listeners.append(server)
    senders = [socket.create_connection(listeners[(i + 1) % workers].getsockname())
               for i in range(workers)]
    receivers = [server.accept()[0] for server in listeners]
    chunk = b"\0" * (1 << 20)
    errors: list[BaseException] = []

    def send(sock):
        try:
            left = nbytes
            while left > 0:
                left -= sock.send(chunk[:min(left, len(chunk))])
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            errors.append(error)

    def receive(sock):
        try:
            left = nbytes
            while left > 0:
                data = sock.recv(min(left, 1 << 20))
                if not data:
                    raise ConnectionError("peer closed early")
                left -= len(data)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=send, args=(s,)) for s in senders]
    threads += [threading.Thread(target=receive, args=(r,)) for r in receivers]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    for sock in senders + receivers + listeners:
        sock.close()
    if errors:
        raise errors[0]
    return elapsed


def measure_link(workers: int = 2, nbytes: int = 64 << 20, repeats: int = 3) -> dict:
    """Raw TCP throughput per worker in a ring (no TensorFlow): the link's achieved rate.

    Meant to run behind a link (`run_in_link(measure_link, link)`); each of `workers`
    threads sends `nbytes` to the next, all at once, like one step of a ring all-reduce.
    """
    _ring_transfer(workers, min(nbytes, 1 << 20))  # warm up
    seconds = min(_ring_transfer(workers, nbytes) for _ in range(repeats))
    per_worker = 8 * nbytes / seconds
    return {"workers": workers, "bytes": nbytes, "seconds": seconds,
            "per_worker_bps": per_worker, "aggregate_bps": per_worker * workers}
