"""Starting the local processes, streaming their output, ending the job when one fails.

Each child runs in its own session (process group) and sets PR_SET_PDEATHSIG itself (child.py), so the launcher
can signal whole groups and a SIGKILLed launcher takes its children along. Output is copied line by line with a `[rank i] `
prefix (i = global process id). When a rank exits non-zero or is killed, every other local rank gets SIGTERM, then
SIGKILL after the grace period, and the launcher exits with the code of the rank that failed first (failures.py:
from what each failing rank's bootstrap noted, a rank that failed on its own is told from one that lost a peer).
Standard library only.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from . import failures
from .env import ENV_FAILURE_FILE, ENV_LAUNCHER_PID, LOG_PREFIX, TIMEOUT_EXIT_CODE


def log(msg: str, lock: threading.Lock | None = None) -> None:
    """One launcher message on stderr, prefixed `jax_ep.launch: `."""
    try:
        if lock is None:
            sys.stderr.write(LOG_PREFIX + msg + "\n")
            sys.stderr.flush()
            return
        with lock:
            sys.stderr.write(LOG_PREFIX + msg + "\n")
            sys.stderr.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def exit_code(code: int) -> int:
    """The launcher's exit code for a child's return code (128 + signal for a signal, like a shell)."""
    return 128 + (-code) if code < 0 else code


class _Child:
    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank = rank  # global process id
        self.proc = proc
        self.pgid = proc.pid  # start_new_session=True: the child leads its own process group
        self.threads: list[threading.Thread] = []
        self.eof: list[float] = []  # when each output pipe closed (the child's fds close when it dies)
        self.reaped: float | None = None

    def death_time(self) -> float:
        """Best estimate of when the child died: its output pipes close while it exits (together with its
        sockets, so before any peer can notice), while reaping a big multi-threaded process can take longer.
        Both are observed late (by a thread that has to be scheduled): take the earlier observation."""
        pipes = max(self.eof) if self.eof and len(self.eof) == len(self.threads) else None
        seen = [t for t in (pipes, self.reaped) if t is not None]
        return min(seen) if seen else time.monotonic()


# Gloo prints one "Rank i is connected to N peer ranks" line per CPU device, piece by piece from several threads at
# once (the pieces come interleaved, even with the program's own output): noise in every CPU job. A line that holds
# nothing but such pieces and numbers is dropped unless --verbose; a line with anything else is kept whole.
_CHATTER_PIECE = re.compile(rb"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :")


def _only_chatter(line: bytes) -> bool:
    rest, pieces = _CHATTER_PIECE.subn(b"", line)
    return pieces > 0 and not rest.strip(b"0123456789 \t\r\n")


def _pump(stream, out, rank: int, lock: threading.Lock, eof: list, verbose: bool = False) -> None:
    """Copy one child stream to `out` line by line, each line prefixed with `[rank i] `."""
    prefix = f"[rank {rank}] ".encode()
    binary = getattr(out, "buffer", None)
    try:
        for line in iter(stream.readline, b""):
            if not verbose and _only_chatter(line):
                continue
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                try:
                    if binary is not None:
                        binary.write(prefix + line)
                        binary.flush()
                    else:
                        out.write((prefix + line).decode(errors="replace"))
                        out.flush()
                except (BrokenPipeError, ValueError, OSError):
                    pass
        eof.append(time.monotonic())
    finally:
        stream.close()


class Supervisor:
    """Runs `argv` once per (rank, env) and supervises the processes until all succeed or one fails."""

    def __init__(self, argv: list[str], ranks: list[int], envs: list[dict], grace_seconds: float,
                 timeout: float | None, verbose: bool = False):
        self.argv, self.ranks, self.envs = argv, ranks, envs
        self.grace_seconds, self.timeout, self.verbose = grace_seconds, timeout, verbose
        self.children: list[_Child] = []
        self.lock = threading.Lock()             # serializes writes to the launcher's stdout/stderr
        self.exits: queue.Queue = queue.Queue()  # (rank, code) in the order the children exited
        self.codes: dict[int, int] = {}
        self.interrupted: int | None = None
        self.stop_time: float | None = None      # when the launcher sent SIGTERM
        self.failures = None                     # the file where failing ranks note when they failed (failures.py)

    def log(self, msg: str) -> None:
        log(msg, self.lock)

    # -- processes ----------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        if self.interrupted is None:
            self.interrupted = signum

    def _waiter(self, c: _Child) -> None:
        code = c.proc.wait()
        c.reaped = time.monotonic()
        self.exits.put((c.rank, code))

    def _running(self) -> list[int]:
        return [c.rank for c in self.children if c.proc.poll() is None]

    def _signal_groups(self, sig, only_running: bool) -> None:
        for c in self.children:
            if only_running and c.proc.poll() is not None:
                continue
            try:
                os.killpg(c.pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_all(self) -> None:
        """SIGTERM every running child's process group, SIGKILL what is left after the grace period."""
        if self.stop_time is None:
            self.stop_time = time.monotonic()
        self._signal_groups(signal.SIGTERM, only_running=True)
        deadline = time.monotonic() + max(self.grace_seconds, 0.0)
        while time.monotonic() < deadline and self._running():
            time.sleep(0.02)
        left = self._running()
        if left:
            self.log(f"ranks {left} still running {self.grace_seconds:g} s after SIGTERM; sending SIGKILL")
        # SIGKILL every group, including those whose leader already exited (leftover grandchildren)
        self._signal_groups(signal.SIGKILL, only_running=False)
        for c in self.children:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.log(f"rank {c.rank} (pid {c.proc.pid}) did not die after SIGKILL")

    def _join_output(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for c in self.children:
            for t in c.threads:
                t.join(max(0.0, deadline - time.monotonic()))

    def _end(self) -> None:
        """Stop every local rank, wait for their output, say how each ended."""
        self._stop_all()
        self._join_output()
        parts = []
        for c in self.children:
            code = c.proc.poll()
            if code is None:
                parts.append(f"rank {c.rank}: still running")
                continue
            after = self.stop_time is not None and c.death_time() >= self.stop_time
            if after and code in (-signal.SIGTERM, -signal.SIGKILL):
                parts.append(f"rank {c.rank}: stopped by the launcher ({signal.Signals(-code).name})")
            else:
                parts.append(f"rank {c.rank}: {describe(code)}" + (" while being stopped" if after else ""))
        self.log("; ".join(parts))

    def _first_failure(self) -> tuple[int, int]:
        """(rank, return code) of the rank that failed first (failures.first_failure)."""
        failed = {c.rank: c for c in self.children if c.proc.poll() not in (None, 0)}
        rank = failures.first_failure(failures.read(self.failures, self.ranks),
                                      {r: c.death_time() for r, c in failed.items()}, self.stop_time)
        return rank, failed[rank].proc.returncode

    # -- main loop ----------------------------------------------------------------------------------------
    def run(self) -> int:
        self.failures = failures.create(len(self.ranks))
        old_handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # not the main thread
                pass
        try:
            # NOTE: no preexec_fn: this process has native threads (jaxlib's, from `import jax_ep`), and Python code
            # run between fork and exec can deadlock on a lock such a thread held at the fork. Each child asks for
            # SIGKILL when the launcher dies itself (child.py, ENV_LAUNCHER_PID).
            fd = self.failures.fileno()
            for i, (rank, env) in enumerate(zip(self.ranks, self.envs)):
                if self.interrupted is not None:
                    break
                env = dict(env, **{ENV_LAUNCHER_PID: str(os.getpid()),
                                   ENV_FAILURE_FILE: f"{fd}:{i}:{len(self.ranks)}"})
                proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True, pass_fds=(fd,))
                self.children.append(_Child(rank, proc))
            failures.write_pids(self.failures, [c.proc.pid for c in self.children], len(self.ranks))
            for c in self.children:
                for stream, out in ((c.proc.stdout, sys.stdout), (c.proc.stderr, sys.stderr)):
                    t = threading.Thread(target=_pump, args=(stream, out, c.rank, self.lock, c.eof, self.verbose),
                                         daemon=True)
                    t.start()
                    c.threads.append(t)
                threading.Thread(target=self._waiter, args=(c,), daemon=True).start()
            return self._wait(time.monotonic())
        except BaseException:
            self._stop_all()
            raise
        finally:
            self.failures.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)

    def _wait(self, start: float) -> int:
        deadline = None if self.timeout is None else start + self.timeout
        while True:
            if self.interrupted is not None:
                self.log(f"received {signal.Signals(self.interrupted).name}; stopping all {len(self.children)} "
                         f"ranks")
                self._end()
                return 128 + int(self.interrupted)
            try:
                rank, code = self.exits.get(timeout=0.05)
            except queue.Empty:
                rank = code = None
            if rank is not None:
                self.codes[rank] = code
                if code != 0:
                    others = self._running()
                    self.log(f"rank {rank} {describe(code)}" + (f"; stopping ranks {others}" if others else ""))
                    self._end()
                    rank, code = self._first_failure()
                    self.log(f"rank {rank} failed first ({describe(code)}); exiting with code {exit_code(code)}")
                    return exit_code(code)
                if len(self.codes) == len(self.children) == len(self.ranks):
                    self._join_output()
                    self._signal_groups(signal.SIGKILL, only_running=False)  # leftover grandchildren, if any
                    return 0
            if deadline is not None and time.monotonic() >= deadline:
                self.log(f"timeout: {self.timeout:g} s elapsed with ranks {self._running()} still running; "
                         f"stopping all ranks and exiting with code {TIMEOUT_EXIT_CODE}")
                self._end()
                self.log(f"timed out after {self.timeout:g} s; exiting with code {TIMEOUT_EXIT_CODE}")
                return TIMEOUT_EXIT_CODE
