"""`keras_dist.launching.local` and `keras-dist launch`: real worker processes (TensorFlow only in
the root-cause test with a real collective)."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import _thread

import psutil
import pytest

from keras_dist.launching import cli
from keras_dist.launching.local import LaunchResult, free_ports, launch, launch_script

pytestmark = pytest.mark.multiworker

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
REPORT_ENV = os.path.join(WORKERS, "report_env.py")
FAIL_ONE = os.path.join(WORKERS, "fail_one.py")


def _read_pids(directory, pattern=".pid"):
    pids = {}
    for name in os.listdir(directory):
        if name.endswith(pattern):
            with open(os.path.join(directory, name)) as file:
                pids[name] = int(file.read())
    return pids


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _assert_all_gone(pids):
    assert pids, "the workers wrote no pid files"
    # Zombies of re-parented grandchildren may take a moment to be reaped by init.
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {name: pid for name, pid in pids.items() if not _gone(pid)}
    assert not left, f"processes left behind: {left}"


def _run_cli(*args, timeout=60, **kwargs):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", "keras_dist", *args], capture_output=True, text=True,
        timeout=timeout, env=env, **kwargs,
    )


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(4)
    assert len(set(ports)) == 4
    assert all(1 <= port <= 65535 for port in ports)


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_all_workers_succeed_and_logs_are_prefixed(tmp_path):
    output = io.StringIO()
    result = launch([sys.executable, REPORT_ENV, str(tmp_path)], 2, stdout=output)
    assert isinstance(result, LaunchResult)
    assert result.returncode == 0
    assert result.worker_returncodes == (0, 0)
    assert result.failed_worker is None and result.restarts == 0
    lines = output.getvalue().splitlines()
    for index in (0, 1):
        assert f"[worker {index}] hello from worker {index}" in lines
        assert f"[worker {index}] warning from worker {index}" in lines  # stderr merged


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_each_worker_gets_its_own_tf_config_on_loopback(tmp_path):
    result = launch(
        [sys.executable, REPORT_ENV, str(tmp_path)], 3,
        env={"KD_TEST_EXTRA": "yes", "TF_CPP_MIN_LOG_LEVEL": None}, stdout=io.StringIO(),
    )
    assert result.returncode == 0
    reports = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(3)]
    configs = [json.loads(report["env"]["TF_CONFIG"]) for report in reports]
    addresses = configs[0]["cluster"]["worker"]
    assert len(addresses) == 3
    assert all(address.startswith("127.0.0.1:") for address in addresses)
    assert len({address.rsplit(":", 1)[1] for address in addresses}) == 3
    for index, (config, report) in enumerate(zip(configs, reports)):
        assert config["cluster"] == {"worker": addresses}
        assert config["task"] == {"type": "worker", "index": index}
        assert report["env"]["KERAS_DIST_LAUNCHED"] == "1"
        assert report["env"]["KERAS_DIST_RESTART"] == "0"
        assert report["env"]["PYTHONUNBUFFERED"] == "1"
        assert report["env"]["TF_CPP_MIN_LOG_LEVEL"] == "2"  # defaulted when unset
        assert report["env"]["KD_TEST_EXTRA"] == "yes"


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_failing_worker_stops_the_others_and_is_named(tmp_path):
    output = io.StringIO()
    started = time.monotonic()
    result = launch(
        [sys.executable, FAIL_ONE, str(tmp_path), "--code", "3", "--grandchild"], 2,
        stdout=output,
    )
    assert time.monotonic() - started < 30  # the other worker sleeps 120 s
    assert result.returncode == 3
    assert result.failed_worker == 1
    assert result.worker_returncodes[1] == 3
    assert result.worker_returncodes[0] == -signal.SIGTERM
    assert "worker 1 exited with code 3" in result.message
    assert "keras-dist launch: worker 1 exited with code 3" in output.getvalue()
    _assert_all_gone(_read_pids(tmp_path))  # worker 0 and the child it started


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_killed_worker_reports_the_signal(tmp_path):
    output = io.StringIO()
    result = launch(
        [sys.executable, FAIL_ONE, str(tmp_path), "--signal", "SIGKILL"], 2, stdout=output
    )
    assert result.returncode == 128 + signal.SIGKILL
    assert result.failed_worker == 1
    assert "worker 1 was killed by signal SIGKILL (9)" in result.message
    assert "worker 1 was killed by signal SIGKILL (9)" in output.getvalue()
    _assert_all_gone(_read_pids(tmp_path))


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_worker_ignoring_sigterm_is_killed_after_grace_period(tmp_path):
    started = time.monotonic()
    result = launch(
        [sys.executable, FAIL_ONE, str(tmp_path), "--ignore-sigterm", "--grandchild"], 2,
        stdout=io.StringIO(), grace_period=0.5,
    )
    assert time.monotonic() - started < 30
    assert result.returncode == 3 and result.failed_worker == 1
    assert result.worker_returncodes[0] == -signal.SIGKILL
    _assert_all_gone(_read_pids(tmp_path))


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_timeout_stops_all_workers_with_124(tmp_path):
    output = io.StringIO()
    result = launch(
        [sys.executable, FAIL_ONE, str(tmp_path), "--fail-worker", "-1"], 2,
        timeout=3, stdout=output,
    )
    assert result.returncode == 124
    assert result.timed_out and result.failed_worker is None
    assert "timed out after 3 s" in output.getvalue()
    _assert_all_gone(_read_pids(tmp_path))


@pytest.mark.multiworker
@pytest.mark.timeout(90)
def test_max_restarts_restarts_the_group_after_a_failure(tmp_path):
    output = io.StringIO()
    result = launch(
        [sys.executable, FAIL_ONE, str(tmp_path), "--fail-attempts", "1"], 2,
        max_restarts=2, stdout=output,
    )
    assert result.returncode == 0
    assert result.restarts == 1
    assert result.worker_returncodes == (0, 0)
    text = output.getvalue()
    assert ("keras-dist launch: restarting worker group (restart 1 of 2) after worker 1 "
            "exited with code 3") in text
    assert "[worker 0] worker 0 attempt 1 started" in text
    _assert_all_gone(_read_pids(tmp_path))


@pytest.mark.multiworker
@pytest.mark.timeout(90)
def test_max_restarts_exhausted_returns_the_failure(tmp_path):
    output = io.StringIO()
    result = launch(
        [sys.executable, FAIL_ONE, str(tmp_path), "--code", "5"], 2, max_restarts=1,
        stdout=output,
    )
    assert result.returncode == 5 and result.restarts == 1 and result.failed_worker == 1
    assert "(restart 1 of 1)" in output.getvalue()
    assert "after 1 restart(s)" in result.message


@pytest.fixture()
def sigint_as_in_a_terminal():
    """Ctrl+C's SIGINT handled as in a terminal's foreground job, whatever this process
    inherited: a shell without job control starts background commands (`cmd &`, so a CI
    script run that way) with SIGINT ignored, and Python then installs no handler for it
    (and its children inherit the ignore)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_default():
    # preexec_fn of a child that must get SIGINT as a foreground job would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_keyboard_interrupt_stops_all_workers(tmp_path, sigint_as_in_a_terminal):
    def interrupt_when_started():
        deadline = time.monotonic() + 30
        while len(_read_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    output = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        launch([sys.executable, FAIL_ONE, str(tmp_path), "--fail-worker", "-1"], 2,
               stdout=output)
    assert "interrupted; stopping all workers" in output.getvalue()
    _assert_all_gone(_read_pids(tmp_path))


@pytest.mark.timeout(60)
def test_default_stream_is_sys_stdout_at_write_time(capsys):
    result = launch([sys.executable, "-c", "print('ping')"], 1)
    assert result.returncode == 0
    assert "[worker 0] ping" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_no_prefix_and_missing_trailing_newline():
    output = io.StringIO()
    launch([sys.executable, "-c", "import sys; sys.stdout.write('a\\nb')"], 1,
           stdout=output, prefix=False)
    assert output.getvalue() == "a\nb\n"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 0}, "Argument `num_workers` must be an integer >= 1. "
                             "Received: num_workers=0"),
        ({"num_workers": True}, "num_workers=True"),
        ({"num_workers": "2"}, "num_workers='2'"),
        ({"max_restarts": -1}, "Argument `max_restarts` must be an integer >= 0"),
        ({"timeout": 0}, "Argument `timeout` must be a number > 0"),
        ({"grace_period": -1}, "Argument `grace_period` must be a number >= 0"),
        ({"env": {"A": 1}}, "Argument `env` must map strings to strings"),
    ],
)
def test_invalid_arguments_are_refused_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        launch([sys.executable, "-c", "pass"], **kwargs)


@pytest.mark.parametrize("command", ["python train.py", [], [sys.executable, 3]])
def test_invalid_command_is_refused(command):
    with pytest.raises(ValueError, match="Argument `command`"):
        launch(command)


def test_launch_script_refuses_a_missing_script(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        launch_script(missing)
    with pytest.raises(ValueError, match="script_args"):
        launch_script(REPORT_ENV, "--epochs 3")


@pytest.mark.timeout(60)
def test_unstartable_command_raises_and_leaves_nothing():
    with pytest.raises(FileNotFoundError):
        launch(["/nonexistent/keras-dist-test-binary"], 2, stdout=io.StringIO())


# -- the command line -------------------------------------------------------------------
@pytest.mark.multiworker
@pytest.mark.timeout(90)
def test_cli_launch_passes_script_arguments_through(tmp_path):
    completed = _run_cli("launch", "--workers", "2", REPORT_ENV, str(tmp_path),
                         "--flag", "x", "--workers", "7")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for index in (0, 1):
        report = json.loads((tmp_path / f"worker-{index}.json").read_text())
        assert report["argv"] == ["--flag", "x", "--workers", "7"]
        assert f"[worker {index}] hello from worker {index}" in completed.stdout


@pytest.mark.multiworker
@pytest.mark.timeout(120)
def test_cli_launch_preload_forks_workers_that_already_imported_tensorflow(tmp_path):
    completed = _run_cli("launch", "--preload", "-n", "1", REPORT_ENV, str(tmp_path))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads((tmp_path / "worker-0.json").read_text())
    assert report["preloaded"] is True
    assert report["env"]["KERAS_DIST_LAUNCHED"] == "1" and report["env"]["TF_CONFIG"]
    # Without the flag, a fresh interpreter.
    completed = _run_cli("launch", "-n", "1", REPORT_ENV, str(tmp_path))
    assert json.loads((tmp_path / "worker-0.json").read_text())["preloaded"] is False


@pytest.mark.multiworker
@pytest.mark.timeout(90)
def test_cli_launch_runs_a_module_with_dash_m(tmp_path):
    completed = _run_cli("launch", "-n", "2", "-m", "report_env", str(tmp_path), "--x",
                         cwd=WORKERS)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert json.loads((tmp_path / "worker-1.json").read_text())["argv"] == ["--x"]


@pytest.mark.multiworker
@pytest.mark.timeout(90)
def test_cli_exit_code_is_the_failing_workers(tmp_path):
    completed = _run_cli("launch", "-n", "2", FAIL_ONE, str(tmp_path), "--code", "7")
    assert completed.returncode == 7
    assert "keras-dist launch: worker 1 exited with code 7" in completed.stdout
    _assert_all_gone(_read_pids(tmp_path))


@pytest.mark.multiworker
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_cli_interrupted_stops_all_workers(tmp_path, signum):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_dist", "launch", "-n", "2", FAIL_ONE, str(tmp_path),
         "--fail-worker", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=_sigint_default,
    )
    try:
        deadline = time.monotonic() + 30
        while len(_read_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signum)
        output, _ = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, output
    assert "interrupted; stopping all workers" in output
    _assert_all_gone(_read_pids(tmp_path))


@pytest.mark.parametrize(
    "args, message",
    [
        (["launch", "--workers", "0", REPORT_ENV], "--workers: must be an integer >= 1"),
        (["launch", "--workers", "two", REPORT_ENV], "expected an integer"),
        (["launch", "--max-restarts", "-1", REPORT_ENV], "--max-restarts: must be an integer"),
        (["launch", "--timeout", "0", REPORT_ENV], "--timeout: must be > 0"),
        (["launch", "missing_script.py"], "script 'missing_script.py' not found"),
        (["launch"], "the following arguments are required: SCRIPT"),
        (["launch", "--bogus", REPORT_ENV], "unrecognized arguments: --bogus"),
        (["bench", "allreduce", "--sizes", "huge"], "expected a size in bytes"),
    ],
)
def test_cli_usage_errors_exit_2_with_a_message(args, message, capsys):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_python_dash_m_keras_dist_reports_usage_errors():
    completed = _run_cli("launch", "--workers", "0", REPORT_ENV)
    assert completed.returncode == 2
    assert "--workers: must be an integer >= 1, received 0" in completed.stderr


def test_cli_bench_allreduce_calls_the_benchmark(monkeypatch):
    calls = []
    fake = types.ModuleType("keras_dist.planning.bench")
    fake.allreduce_main = lambda args: calls.append(args) or 0
    monkeypatch.setitem(sys.modules, "keras_dist.planning.bench", fake)
    assert cli.main(["bench", "allreduce", "--workers", "3", "--sizes", "4K", "1M"]) == 0
    assert calls[0].workers == 3
    assert calls[0].sizes == [4096, 1 << 20]


def test_cli_info_and_demo_call_their_modules(monkeypatch, capsys):
    strategy = types.ModuleType("keras_dist.strategies.factory")
    strategy._info_lines = lambda: ["cluster: fake", "strategy: fake"]
    demo = types.ModuleType("keras_dist.examples.demo")
    demo_calls = []
    demo.main = lambda argv: demo_calls.append(argv)
    monkeypatch.setitem(sys.modules, "keras_dist.strategies.factory", strategy)
    monkeypatch.setitem(sys.modules, "keras_dist.examples.demo", demo)
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out.splitlines() == ["cluster: fake", "strategy: fake"]
    assert cli.main(["demo", "--workers", "2", "--epochs", "1"]) == 0
    assert demo_calls == [["--workers", "2", "--epochs", "1"]]


# -- output: live progress, quiet start-up, log files, the root cause last --------------
PROGRESS = os.path.join(WORKERS, "progress.py")
NOISY = os.path.join(WORKERS, "noisy.py")
ROOT_CAUSE = os.path.join(WORKERS, "root_cause.py")


class _Terminal(io.StringIO):
    """A stream that says it is a terminal and records when each write arrived."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def isatty(self):
        return True

    def write(self, text):
        self.writes.append((time.monotonic(), text))
        return super().write(text)


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_progress_updates_reach_a_terminal_live_with_the_prefix_kept():
    terminal = _Terminal()
    result = launch([sys.executable, PROGRESS, "6", "0.5"], 2, stdout=terminal)
    ended = time.monotonic()
    assert result.returncode == 0
    first = next(t for t, text in terminal.writes if "[worker 0] step 1/6" in text)
    assert ended - first > 1.5, "the first update arrived only when the worker ended"
    text = terminal.getvalue()
    assert "\b" not in text
    # Every '\r' redraws the chief's bar with its prefix; the other worker's bar is not
    # live (one bar on the terminal) and ends as one line.
    assert all(part.startswith("[worker 0] step") for part in text.split("\r")[1:])
    assert "[worker 1] step 6/6\n" in text and "[worker 1] step 1/6" not in text
    assert "[worker 0] done\n" in text and "[worker 1] done\n" in text


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_progress_without_a_terminal_has_no_carriage_returns():
    output = io.StringIO()
    assert launch([sys.executable, PROGRESS, "4", "0.05"], 2, stdout=output).returncode == 0
    lines = output.getvalue().split("\n")
    assert "\r" not in output.getvalue() and "\b" not in output.getvalue()
    for index in (0, 1):
        assert lines.count(f"[worker {index}] step 4/4") == 1
        assert f"[worker {index}] step 1/4" not in lines


@pytest.mark.timeout(60)
def test_start_up_noise_is_dropped_unless_verbose(monkeypatch):
    quiet = io.StringIO()
    launch([sys.executable, NOISY], 1, stdout=quiet)
    assert quiet.getvalue().splitlines() == [
        "[worker 0] W0000 00:00:1796297343.575729   25638 some_op.cc:12] a real warning",
        "[worker 0] useful output",
    ]
    verbose = io.StringIO()
    launch([sys.executable, NOISY], 1, stdout=verbose, verbose=True)
    assert "absl::InitializeLog()" in verbose.getvalue()
    assert "failed call to cuInit" in verbose.getvalue()
    monkeypatch.setenv("KERAS_DIST_TF_LOGS", "1")
    from_env = io.StringIO()
    launch([sys.executable, NOISY], 1, stdout=from_env)
    assert "cudart_stub.cc" in from_env.getvalue()


@pytest.mark.timeout(60)
def test_log_dir_writes_one_file_per_worker_and_the_launchers(tmp_path, capsys):
    logs = tmp_path / "logs"
    assert cli.main(["launch", "-n", "2", "--log-dir", str(logs), FAIL_ONE, str(tmp_path),
                     "--code", "4"]) == 4
    out = capsys.readouterr().out
    assert "[worker" not in out  # without --tee, worker output goes to the files only
    assert "keras-dist launch: worker 1 exited with code 4" in out
    assert "worker 1 failing now" in (logs / "worker-1.log").read_text()
    assert "worker 0 attempt 0 started" in (logs / "worker-0.log").read_text()
    assert "worker 1 exited with code 4" in (logs / "launcher.log").read_text()
    tee = tmp_path / "tee"
    assert cli.main(["launch", "-n", "1", "--log-dir", str(tee), "--tee", NOISY]) == 0
    assert "[worker 0] useful output" in capsys.readouterr().out
    assert "absl::InitializeLog()" in (tee / "worker-0.log").read_text()  # files keep all


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_the_root_cause_comes_last():
    output = io.StringIO()
    result = launch([sys.executable, ROOT_CAUSE], 2, stdout=output)
    assert result.failed_worker == 1 and result.returncode == 1
    lines = output.getvalue().splitlines()
    assert "Collective ops is aborted" in output.getvalue()  # the cascade, printed first
    summary = lines[lines.index("keras-dist launch: root cause: worker 1 exited with code 1 "
                                "(the first worker to fail); the end of its output:"):]
    assert summary[1].strip() == "Traceback (most recent call last):"
    assert summary[-2].strip() == "ValueError: the root cause, on worker 1"
    assert summary[-1] == "keras-dist launch: worker 1 exited with code 1"
    assert not any("Collective ops" in line for line in summary)


@pytest.mark.multiworker
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_the_root_cause_is_the_worker_that_raised_while_the_other_was_in_a_collective():
    output = io.StringIO()
    result = launch([sys.executable, os.path.join(WORKERS, "collective_failure.py")], 2,
                    stdout=output, env={"PYTHONPATH": REPO_ROOT}, timeout=100)
    assert result.failed_worker == 1 and result.returncode == 1, output.getvalue()[-3000:]
    lines = output.getvalue().splitlines()
    start = lines.index("keras-dist launch: root cause: worker 1 exited with code 1 (the "
                        "first worker to fail); the end of its output:")
    assert lines[start + 1].strip() == "Traceback (most recent call last):"
    assert lines[-2].strip() == "ValueError: worker 1 failed before its all-reduce"
    assert lines[-1] == "keras-dist launch: worker 1 exited with code 1"


def test_tee_needs_a_log_dir(capsys):
    with pytest.raises(ValueError, match="Argument `tee` must be False without `log_dir`"):
        launch([sys.executable, "-c", "pass"], 1, tee=True)
    assert cli.main(["launch", "--tee", REPORT_ENV]) == 2
    assert "--tee needs --log-dir DIR" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_cli_verbose_keeps_start_up_noise(capsys):
    assert cli.main(["launch", "-n", "1", "--verbose", NOISY]) == 0
    assert "[worker 0] WARNING: All log messages before absl::InitializeLog()" in \
        capsys.readouterr().out
