"""keras_dist.planning: the alpha-beta model's math, `keras-dist plan`, the link simulator.

The model tests are pure Python (no TensorFlow). The simulator test builds a private
network namespace with a rate-limited loopback (root or CAP_NET_ADMIN) and is skipped,
with the reason, where that is impossible. Nothing here asserts a speed of this machine:
the simulator test checks only that the token bucket holds a transfer to at most its
rate (a ceiling tc enforces), never how fast anything runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import time

import pytest

from keras_dist import planning
from keras_dist.launching import cli
from keras_dist.planning import model as pmodel


# -- parsing ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("10gbit", 10e9), ("1Gbit", 1e9), ("100mbit", 100e6), ("2.5gbit", 2.5e9),
    ("64kbit", 64e3), (25e9, 25e9)])
def test_parse_rate(text, expected):
    assert planning.parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["10", "10gb", "10 GB/s", "fast", "-1gbit", "0gbit", ""])
def test_parse_rate_refuses_unknown_units(text):
    with pytest.raises(ValueError, match="link rate"):
        planning.parse_rate(text)


@pytest.mark.parametrize("text, expected", [("50us", 50e-6), ("1ms", 1e-3), ("0", 0.0),
                                            ("2s", 2.0)])
def test_parse_duration(text, expected):
    assert planning.parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["50", "5 parsecs", "-1ms"])
def test_parse_duration_refuses(text):
    with pytest.raises(ValueError, match="duration"):
        planning.parse_duration(text)


# -- the model ------------------------------------------------------------------------------
def test_allreduce_time_formula():
    # N = 4, 1 MB, alpha 10 us, beta 1 ns/byte: 6 * 10 us + 1.5 * 1e6 * 1 ns.
    assert planning.allreduce_time(1e6, 4, 10e-6, 1e-9) == pytest.approx(60e-6 + 1.5e-3)
    assert planning.allreduce_time(1e6, 1, 10e-6, 1e-9) == 0.0


@pytest.mark.parametrize("alpha, beta", [(50e-6, 2e-9), (1e-3, 1e-8), (0.0, 4e-9),
                                         (2e-4, 0.0)])
def test_fit_recovers_known_alpha_beta(alpha, beta):
    rng = random.Random(0)
    samples = []
    for workers in (2, 4, 8):
        for size in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26):
            noise = 1 + rng.uniform(-0.01, 0.01)
            seconds = planning.allreduce_time(size, workers, alpha, beta) * noise
            samples.append((workers, size, seconds))
    fitted_alpha, fitted_beta, error = planning.fit_alpha_beta(samples)
    assert fitted_alpha == pytest.approx(alpha, rel=0.05, abs=1e-7)
    assert fitted_beta == pytest.approx(beta, rel=0.05, abs=1e-12)
    assert error < 0.03


def test_fit_is_exact_without_noise_and_never_negative():
    samples = [(2, size, planning.allreduce_time(size, 2, 3e-4, 5e-9))
               for size in (1 << 12, 1 << 20, 1 << 24)]
    alpha, beta, error = planning.fit_alpha_beta(samples)
    assert (alpha, beta) == (pytest.approx(3e-4), pytest.approx(5e-9))
    assert error < 1e-9
    # Times falling with size: the unconstrained fit has beta < 0; it is clamped.
    alpha, beta, _ = planning.fit_alpha_beta([(2, 1e3, 2e-3), (2, 1e6, 1e-3)])
    assert alpha >= 0 and beta >= 0


def test_fit_needs_two_distinct_sizes():
    with pytest.raises(ValueError, match="distinct"):
        planning.fit_alpha_beta([(2, 1024, 1e-3)])
    with pytest.raises(ValueError, match="distinct"):
        planning.fit_alpha_beta([(2, 1024, 1e-3), (2, 1024, 2e-3)])


def test_predictions_are_monotone():
    workers = [2, 4, 8, 16, 32, 64, 128, 256]
    for rate in ("1gbit", "10gbit", "100gbit"):
        rows = planning.predict(25e6, 100.0, link_rate=rate, workers=workers)
        steps = [row.step_ms for row in rows]
        efficiency = [row.efficiency for row in rows]
        assert steps == sorted(steps) and efficiency == sorted(efficiency, reverse=True)
        assert all(0 < e <= 1 for e in efficiency)
        speedups = [row.speedup for row in rows]
        assert speedups == sorted(speedups)  # more workers never lose throughput here
    # Faster links, compression and accumulation each help; more params hurt.
    at = {rate: planning.predict(25e6, 100.0, link_rate=rate, workers=[64])[0].efficiency
          for rate in ("1gbit", "10gbit", "25gbit", "100gbit")}
    assert at["1gbit"] < at["10gbit"] < at["25gbit"] < at["100gbit"] <= 1
    fp32 = planning.predict(25e6, 100.0, link_rate="10gbit", workers=[64])[0]
    bf16 = planning.predict(25e6, 100.0, link_rate="10gbit", workers=[64],
                            compression="bf16")[0]
    accumulated = planning.predict(25e6, 100.0, link_rate="10gbit", workers=[64],
                                   accumulation=4)[0]
    overlapped = planning.predict(25e6, 100.0, link_rate="10gbit", workers=[64],
                                  overlap=1.0)[0]
    assert bf16.allreduce_ms == pytest.approx(fp32.allreduce_ms / 2, rel=0.01)
    assert fp32.efficiency < bf16.efficiency and fp32.efficiency < accumulated.efficiency
    assert fp32.efficiency < overlapped.efficiency
    big = planning.predict(100e6, 100.0, link_rate="10gbit", workers=[64])[0]
    assert big.efficiency < fp32.efficiency


def test_prediction_numbers():
    # 25M fp32 params = 100 MB; N = 2 at 1 Gbit, ideal engine (5 us/step):
    # t = 2 * 5 us + 1 * 100e6 B * 8 / 1e9 = 0.80001 s.
    row = planning.predict(25e6, 200.0, link_rate="1gbit", workers=[2])[0]
    assert row.allreduce_ms == pytest.approx(800.01)
    assert row.step_ms == pytest.approx(1000.01)
    assert row.efficiency == pytest.approx(200 / 1000.01)
    assert row.speedup == pytest.approx(2 * 200 / 1000.01)
    # Accumulation 4: one all-reduce per 4 micro-batches.
    row = planning.predict(25e6, 200.0, link_rate="1gbit", workers=[2], accumulation=4)[0]
    assert row.step_ms == pytest.approx((4 * 200 + 800.01) / 4)
    # Overlap 0.5 hides up to 100 ms of the all-reduce.
    row = planning.predict(25e6, 200.0, link_rate="1gbit", workers=[2], overlap=0.5)[0]
    assert row.step_ms == pytest.approx(900.01)
    # A fixed 10 ms per distributed step.
    row = planning.predict(25e6, 200.0, link_rate="1gbit", workers=[2], overhead_ms=10)[0]
    assert row.step_ms == pytest.approx(1010.01)
    # One worker never communicates.
    row = planning.predict(25e6, 200.0, workers=[1])[0]
    assert row.efficiency == 1.0 and row.allreduce_ms == 0.0


def test_custom_engine_and_link_latency():
    engine = planning.Engine("slow", 1e-3, 1e-8)
    row = planning.predict(1e6, 10.0, link_rate="10gbit", workers=[4], engine=engine,
                           link_latency="100us")[0]
    expected = planning.allreduce_time(4e6, 4, 1e-3 + 100e-6, 1e-8 + 8 / 10e9)
    assert row.allreduce_ms == pytest.approx(1000 * expected)
    assert planning.load_engine({"alpha_s": 1e-3, "beta_s_per_byte": 1e-8}).alpha_s == 1e-3


@pytest.mark.parametrize("kwargs, fragment", [
    ({"params": -5}, "params must be a number > 0"),
    ({"params": 0}, "params must be a number > 0"),
    ({"step_ms": float("nan")}, "step_ms must be a number > 0"),
    ({"link_rate": "10 GB/s"}, "Unknown link rate"),
    ({"workers": [0]}, "workers must be integers >= 1"),
    ({"compression": "int8"}, "Unknown compression"),
    ({"accumulation": 0}, "accumulation must be an integer >= 1"),
    ({"overlap": 1.5}, r"overlap must be a number in \[0, 1\]"),
    ({"engine": "warp-drive"}, "Unknown engine"),
    ({"overhead_ms": -1}, "overhead_ms must be a number >= 0"),
    ({"engine": {"alpha_s": 1}}, "needs numbers 'alpha_s' and 'beta_s_per_byte'"),
])
def test_predict_refuses_bad_arguments(kwargs, fragment):
    arguments = dict(params=1e6, step_ms=10.0)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=fragment):
        planning.predict(arguments.pop("params"), arguments.pop("step_ms"), **arguments)


# -- keras-dist plan ------------------------------------------------------------------------
def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_plan_prints_a_table():
    code, out, _ = _cli("plan", "--params", "25M", "--step-ms", "120", "--link-rate", "25gbit",
                        "--workers", "2", "64")
    assert code == 0
    lines = [line for line in out.splitlines() if line.strip().startswith("25 Gbit")]
    assert [line.split()[2] for line in lines] == ["2", "64"]
    expected = planning.predict(25e6, 120.0, link_rate="25gbit", workers=[2, 64])
    for line, row in zip(lines, expected):
        assert float(line.split()[-2]) == pytest.approx(row.efficiency, abs=0.005)
    assert "25,000,000 params" in out


def test_plan_json_defaults_cover_the_grid():
    code, out, _ = _cli("plan", "--params", "1.3B", "--step-ms", "800", "--json",
                        "--compression", "none", "bf16", "--accumulation", "1", "8")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 2 * 2 * len(planning.DEFAULT_LINK_RATES) * len(planning.DEFAULT_WORKERS)
    assert {row["workers"] for row in rows} == set(planning.DEFAULT_WORKERS)
    assert {row["compression"] for row in rows} == {"none", "bf16"}
    assert all(math.isfinite(row["step_ms"]) for row in rows)


@pytest.mark.parametrize("argv, fragment", [
    (["--params", "-3", "--step-ms", "10"], "--params: must be > 0 parameters"),
    (["--params", "lots", "--step-ms", "10"], "expected a parameter count"),
    (["--params", "1M", "--step-ms", "0"], "--step-ms: must be > 0 ms"),
    (["--params", "1M", "--step-ms", "10", "--link-rate", "10gb"], "Unknown link rate '10gb'"),
    (["--params", "1M", "--step-ms", "10", "--workers", "0"], "--workers: must be an integer"),
    (["--params", "1M", "--step-ms", "10", "--overlap", "2"], "--overlap: must be in [0, 1]"),
    (["--params", "1M", "--step-ms", "10", "--engine", "nope"], "Unknown engine 'nope'"),
    (["--step-ms", "10"], "the following arguments are required: --params"),
])
def test_plan_bad_inputs(argv, fragment):
    code, _, err = _cli("plan", *argv)
    assert code == 2
    assert fragment in err


def test_bench_allreduce_refuses_unknown_rate_unit():
    code, _, err = _cli("bench", "allreduce", "--link-rate", "10GB")
    assert code == 2 and "Unknown link rate '10GB'" in err


# -- the link simulator --------------------------------------------------------------------
def test_link_commands_account_for_the_shared_loopback_qdisc():
    link = planning.Link.parse("10gbit", workers=4)
    assert link.qdisc_rate_bps == 40e9  # one qdisc carries all 4 workers' links
    commands = link.setup_commands()
    assert commands[0] == ["ip", "link", "set", "lo", "up"]
    assert commands[-1][:6] == ["tc", "qdisc", "add", "dev", "lo", "root"]
    assert "40000000000bit" in commands[-1]
    latency = planning.Link.parse("1gbit", "50us").setup_commands()
    assert "netem" in latency[1] and "parent" in latency[2]
    assert planning.Link.parse(None).setup_commands() == [["ip", "link", "set", "lo", "up"]]


def _simulator_or_skip(link):
    try:
        planning.check_support(link)
    except planning.LinkSimulatorError as error:
        pytest.skip(f"link simulator unavailable here: {error}")


@pytest.mark.timeout(60)
@pytest.mark.multiworker
def test_simulated_link_caps_a_transfer_at_its_rate():
    # 100 Mbit per worker, 2 workers (a 200 Mbit tbf): 4 MB each way takes >= ~0.3 s
    # at the cap (the first 256 KB bucket may pass at once). tc enforces the ceiling,
    # so the check cannot fail on a slow machine; only a missing limit fails it.
    link = planning.Link.parse("100mbit", workers=2)
    _simulator_or_skip(link)
    result = planning.run_in_link(planning.measure_link, link,
                                  kwargs={"workers": 2, "nbytes": 4 << 20, "repeats": 1},
                                  timeout=50)
    assert result["per_worker_bps"] <= 1.15 * 100e6
    assert result["aggregate_bps"] == pytest.approx(2 * result["per_worker_bps"])


@pytest.mark.timeout(60)
@pytest.mark.multiworker
def test_run_in_link_returns_values_and_raises_errors():
    link = planning.Link.parse(None)
    _simulator_or_skip(link)

    def addresses():
        import socket

        return socket.gethostbyname("localhost"), socket.if_nameindex()

    localhost, interfaces = planning.run_in_link(addresses, link, timeout=50)
    assert localhost == "127.0.0.1"
    assert [name for _, name in interfaces] == ["lo"]  # a private namespace: loopback only

    def fails():
        raise ArithmeticError("boom behind the link")

    with pytest.raises(planning.LinkSimulatorError, match="boom behind the link"):
        planning.run_in_link(fails, link, timeout=50)


@pytest.mark.multiworker
def test_missing_tools_and_privileges_give_clear_errors(monkeypatch, tmp_path):
    import os
    import shutil

    from keras_dist.planning import link as link_module

    monkeypatch.setattr(link_module, "_PREFIX_CACHE", {})
    monkeypatch.setattr(link_module, "_has_cap_net_admin", lambda: False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(planning.LinkSimulatorError, match="needs the programs unshare, ip, tc"):
        planning.check_support(planning.Link.parse("1gbit"))
    # An `unshare` that the kernel refuses, as for a user without CAP_NET_ADMIN where
    # user namespaces are disabled; `ip` and `tc` are the real ones.
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("ip", "tc"):
        if not shutil.which(tool, path=os.defpath + ":/usr/sbin:/sbin"):
            pytest.skip(f"{tool} not installed")
        (tools / tool).symlink_to(shutil.which(tool, path=os.defpath + ":/usr/sbin:/sbin"))
    refused = tools / "unshare"
    refused.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2"
                       "\nexit 1\n")
    refused.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    with pytest.raises(planning.LinkSimulatorError,
                       match="needs root or CAP_NET_ADMIN.*Operation not permitted"):
        planning.check_support(planning.Link.parse("1gbit"))


@pytest.mark.timeout(60)
@pytest.mark.multiworker
def test_run_in_link_leaves_no_process_behind():
    # A launched worker runs in its own session (setsid), out of reach of the link
    # process's group; a stray one (e.g. stuck in a collective) must still not outlive
    # the call. The stray here sleeps; its pid comes back for the check. Its command line
    # carries a mark of this test: other tests' workers leave sleepers of their own.
    link = planning.Link.parse(None)
    _simulator_or_skip(link)
    mark = f"run_in_link stray {os.getpid()} {time.monotonic_ns()}"

    def leave_a_stray(seconds):
        import subprocess
        import sys

        stray = subprocess.Popen([sys.executable, "-c",
                                  f"import time; time.sleep({seconds})  # {mark}"],
                                 start_new_session=True)
        return stray.pid

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as file:
                return file.read().split(") ")[1][0] != "Z"
        except OSError:
            return False

    pid = planning.run_in_link(leave_a_stray, link, kwargs={"seconds": 120}, timeout=50)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)

    def hang(seconds):
        leave_a_stray(seconds)
        import time as clock

        clock.sleep(seconds)

    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        planning.run_in_link(hang, link, kwargs={"seconds": 120}, timeout=3)
    leftover = [entry for entry in os.listdir("/proc") if entry.isdigit()
                and _cmdline(entry).endswith(mark)]
    assert leftover == []


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
