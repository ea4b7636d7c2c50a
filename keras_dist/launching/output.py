"""Worker output for the launchers: prefixes, live '\\r' progress, the noise filter, log files.

Each worker's merged stdout/stderr is read in chunks as it arrives (never line by line, so
a progress bar that only writes '\\r' updates is seen while it runs) and turned into:

* complete lines, prefixed `[worker i] `, written to the launcher's stream, to the
  worker's log file and to a short tail kept for the failure summary;
* on a terminal (or in Jupyter), the chief's '\\r' updates as one live line that keeps
  its prefix; elsewhere (CI, a file) those updates are dropped and only the line each
  progress bar ends with is written, so logs hold no '\\r' garbage.

Quiet by default: TensorFlow's start-up chatter (which `TF_CPP_MIN_LOG_LEVEL` does not
silence) is dropped from the terminal, and Keras' `shuffle=True ... will be ignored`
warning is switched off in the workers; `verbose=True` or `KERAS_DIST_TF_LOGS=1` keeps
everything. Real warnings and errors always pass.
"""

from __future__ import annotations

import codecs
import collections
import os
import re
import sys
import threading
from typing import IO, Mapping

__all__ = ["Output", "WorkerStream", "pump", "quiet_env", "is_quiet", "failure_excerpt"]

# Start-up lines of TensorFlow/absl/CUDA that say nothing about the user's run.
NOISE = re.compile("|".join([
    r"All log messages before absl::InitializeLog\(\) is called",
    r"cudart_stub\.cc",
    r"Could not find cuda drivers on your machine",
    r"failed call to cuInit",
    r"oneDNN custom operations are on",
    r"This TensorFlow binary is optimized to use available CPU instructions",
    r"rebuild TensorFlow with the appropriate compiler flags",
    r"Unable to register cu(DNN|FFT|BLAS) factory",
    r"computation placer already registered",
    r"TF-TRT Warning: Could not find TensorRT",
]))
# Keras warns on every `fit` of a tf.data.Dataset (what keras_dist hands it): the
# dataset is shuffled already, so the warning is noise. A warnings filter, not a line
# filter, so the worker's own code still decides everything else.
_SHUFFLE_FILTER = "ignore:`shuffle=True` was passed:UserWarning"
_TAIL_LINES = 200
_READ_SIZE = 65536


def is_quiet(verbose: bool | None, environ: Mapping[str, str]) -> bool:
    """False when `verbose` is True, or it is None and `KERAS_DIST_TF_LOGS` is set."""
    if verbose is None:
        verbose = environ.get("KERAS_DIST_TF_LOGS", "").strip().lower() in (
            "1", "true", "yes", "on")
    return not verbose


def quiet_env(env: dict, quiet: bool, explicit: Mapping[str, str | None]) -> None:
    """Sets the workers' logging variables in `env` (those the caller set explicitly win)."""
    if "TF_CPP_MIN_LOG_LEVEL" not in explicit:
        if quiet:
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        else:
            env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    if quiet:
        existing = env.get("PYTHONWARNINGS")
        if not existing:
            env["PYTHONWARNINGS"] = _SHUFFLE_FILTER
        elif _SHUFFLE_FILTER not in existing.split(","):  # a worker's own launch: set
            env["PYTHONWARNINGS"] = f"{existing},{_SHUFFLE_FILTER}"
    else:
        env["KERAS_DIST_TF_LOGS"] = "1"


class Output:
    """The launcher's thread-safe writer: complete lines, and at most one live line.

    `stream=None` resolves `sys.stdout` at write time (so Jupyter and pytest capture
    work). `log_path` also gets every launcher message.
    """

    def __init__(self, stream: IO[str] | None, log_path: str | None = None):
        self._stream = stream
        self._lock = threading.Lock()
        self._live_width: int | None = None
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None

    @property
    def live(self) -> bool:
        """Whether '\\r' updates render here: a terminal, or a Jupyter kernel's stdout."""
        stream = self._resolve()
        try:
            if stream is not None and stream.isatty():
                return True
        except (AttributeError, ValueError):
            return False
        return stream is sys.stdout and "ipykernel" in sys.modules

    def line(self, text: str) -> None:
        with self._lock:
            # A line from someone else ends the live line first, so neither is garbled.
            head = "\n" if self._live_width is not None else ""
            self._live_width = None
            self._emit(head + text + "\n")

    def message(self, text: str) -> None:
        """A launcher message: the stream and the launcher's log file."""
        self.line(text)
        if self._log is not None:
            _write_quietly(self._log, text + "\n")

    def show_live(self, text: str) -> None:
        with self._lock:
            pad = " " * max(0, (self._live_width or 0) - len(text))
            self._live_width = len(text)
            self._emit("\r" + text + pad)

    def end_live(self) -> None:
        with self._lock:
            if self._live_width is not None:
                self._live_width = None
                self._emit("\n")

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _resolve(self):
        return self._stream if self._stream is not None else sys.stdout

    def _emit(self, text: str) -> None:
        stream = self._resolve()
        if stream is not None:  # None under pythonw and some embedded interpreters
            _write_quietly(stream, text)


def _write_quietly(stream, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        # A closed or broken stream must not kill the reader thread: it has to keep
        # draining the pipe or the worker blocks on a full pipe buffer.
        pass


class WorkerStream:
    """Turns one worker's raw output into lines (and live updates) for an `Output`.

    Args:
        label: The prefix, e.g. `"[worker 0] "`, or `""`.
        output: Where lines go; `None` writes only to the log file (`--log-dir` without
            `--tee`).
        live: Show '\\r' updates as a live line (the chief, on a terminal).
        quiet: Drop TensorFlow's start-up noise from `output` (the log file keeps it).
        log_file: An open text file for this worker, or `None`.
    """

    def __init__(self, label: str, output: Output | None, *, live: bool, quiet: bool,
                 log_file: IO[str] | None = None):
        self.label = label
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._output, self._live, self._quiet, self._log = output, live, quiet, log_file
        self._segment = ""  # text since the last '\r' or '\n'
        self._updating = False  # the current line has had a '\r': a progress bar

    def feed(self, text: str) -> None:
        for piece in re.split(r"(\r|\n)", text.replace("\b", "").replace("\r\n", "\n")):
            if piece == "\n":
                self._end_line()
            elif piece == "\r":
                self._segment, self._updating = "", True
            elif piece:
                self._segment += piece
                if self._updating and self._live and self._output is not None:
                    self._output.show_live(self.label + self._segment)

    def close(self) -> None:
        if self._segment:
            self._end_line()
        elif self._updating and self._live and self._output is not None:
            self._output.end_live()

    def _end_line(self) -> None:
        line, was_live = self._segment, self._updating and self._live
        self._segment, self._updating = "", False
        if self._log is not None:
            _write_quietly(self._log, line + "\n")
        noise = bool(NOISE.search(line))
        if not noise:
            self.tail.append(line)
        if self._output is None:
            return
        if was_live:
            self._output.show_live(self.label + line)
            self._output.end_live()
        elif not (noise and self._quiet):
            self._output.line(self.label + line)


def pass_on(pipe, verbose: bool) -> None:
    """Copies a helper process's output (bytes) to stderr, TensorFlow's noise left out."""
    for raw in pipe:
        line = raw.decode("utf-8", "replace")
        if verbose or not NOISE.search(line):
            sys.stderr.write(line)
            sys.stderr.flush()


def pump(pipe, stream: WorkerStream) -> None:
    """Reads `pipe` until EOF, in chunks as they arrive, into `stream`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    descriptor = pipe.fileno()
    try:
        while True:
            chunk = os.read(descriptor, _READ_SIZE)
            if not chunk:
                break
            stream.feed(decoder.decode(chunk))
        stream.feed(decoder.decode(b"", final=True))
        stream.close()
    finally:
        pipe.close()


def failure_excerpt(tail, max_lines: int = 25) -> list[str]:
    """The end of a worker's output: from its last traceback on, else its last lines."""
    lines = list(tail)
    starts = [i for i, line in enumerate(lines)
              if line.lstrip().startswith("Traceback (most recent call last)")]
    excerpt = lines[starts[-1]:] if starts else lines[-10:]
    if len(excerpt) > max_lines:  # keep the header, the innermost frames and the error
        excerpt = excerpt[:1] + ["..."] + excerpt[2 - max_lines:]
    return excerpt
