"""Single-host launcher for the one-process-per-GPU model, and the child-side `init_from_env()`.

    python -m jax_ep.launch -n N [options] script.py [args...]
    python -m jax_ep.launch -n N [options] -m package.module [args...]

starts N copies of the program on this host (rank i gets one GPU of the visible ones, pinned through
CUDA_VISIBLE_DEVICES), gives them a coordinator on a free loopback port, streams their output prefixed with
`[rank i] `, and propagates failures: when a rank exits non-zero or is killed, the others are terminated
(SIGTERM, then SIGKILL after --grace-seconds), the launcher says which rank failed first and exits with its code.

Environment each child gets:
    JAX_EP_COORDINATOR=127.0.0.1:<port>  JAX_EP_NUM_PROCESSES=N  JAX_EP_PROCESS_ID=i
    CUDA_VISIBLE_DEVICES=<the i-th visible GPU(s)>       (GPU machines, unless --no-gpu-pinning)
    NVSHMEM_DISABLE_NVLS=1  NCCL_NVLS_ENABLE=0            (always: NVLink multicast stays off)
    XLA_PYTHON_CLIENT_PREALLOCATE=false                   (unless already set)
    PYTHONUNBUFFERED=1                                    (so output streams live)

A child calls `jax_ep.launch.init_from_env()` before any JAX computation; it runs `jax.distributed.initialize`
from those variables (and returns (0, 1) without initializing when they are absent, so the same script runs
standalone). See docs/PROCESS_MODELS.md.

This module imports no JAX at module level: the launcher process never touches an accelerator.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["init_from_env", "main", "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID"]

ENV_COORDINATOR = "JAX_EP_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_EP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_EP_PROCESS_ID"

# Set in every child, whatever the parent's environment says (NVLink multicast must never be enabled).
FORCED_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}
# Set in every child unless the user set them.
DEFAULT_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}

TIMEOUT_EXIT_CODE = 124
_PREFIX = "jax_ep.launch: "

# Each child runs the user's program through this bootstrap (`python -u -c BOOTSTRAP script|-m target args`).
# Why: after jax.distributed.initialize, JAX's atexit hook waits in a shutdown barrier for every other process
# (shutdown_timeout_seconds, 300 s by default), so a rank that fails with an exception or sys.exit(3) while the
# others sit in a collective would never exit and the launcher could not see the failure. The bootstrap runs the
# program like `python script.py` / `python -m module` would (runpy, sys.argv, sys.path[0]), and on failure
# prints the traceback as Python would, flushes, and leaves with os._exit(code), skipping atexit hooks. A
# successful program exits normally (atexit hooks and the barrier run, every rank is there).
# It imports nothing from jax_ep, so the program's own imports and JAX configuration come first.
CHILD_BOOTSTRAP = r"""
import os, runpy, sys, traceback
def _jax_ep_launch_child():
    mode, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    code = 0
    try:
        if mode == "-m":
            sys.argv = [target] + args
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target] + args
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        return
    except SystemExit as e:
        if e.code is None or e.code == 0:
            raise
        if isinstance(e.code, int):
            code = e.code & 0xFF if e.code & 0xFF else 1
        else:
            try:
                print(e.code, file=sys.stderr)
            except Exception:
                pass
            code = 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and (tb.tb_frame.f_code.co_filename == "<string>"
                                  or tb.tb_frame.f_globals.get("__name__") == "runpy"):
            tb = tb.tb_next
        try:
            e.__traceback__ = tb
            sys.excepthook(type(e), e, tb)
        except Exception:
            traceback.print_exception(type(e), e, tb)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    try:
        import logging
        logging.shutdown()
    except Exception:
        pass
    os._exit(code)
_jax_ep_launch_child()
"""


# ---------------------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------------------
_init_state: tuple[int, int] | None = None
_init_lock = threading.Lock()


def init_from_env(**initialize_kwargs) -> tuple[int, int]:
    """Join the job started by `python -m jax_ep.launch`; returns (process_id, num_processes).

    When JAX_EP_COORDINATOR / JAX_EP_NUM_PROCESSES / JAX_EP_PROCESS_ID are all set, calls
    `jax.distributed.initialize(coordinator_address, num_processes, process_id, **initialize_kwargs)`; when none
    is set, returns (0, 1) and initializes nothing (single-process run). Only some of them set is an error.
    Idempotent: later calls return the first call's answer. Turns JAX's preemption service off (it makes the
    process ignore SIGTERM) unless JAX_ENABLE_PREEMPTION_SERVICE is set. Call it before any JAX computation (the CPU
    collectives implementation and the distributed client must be in place before backends are created).
    On CPU, multi-process collectives need `jax_cpu_collectives_implementation` = 'gloo' (the default on
    jax 0.10.2); it is set to 'gloo' here only if it is 'none'/unset.
    """
    global _init_state
    with _init_lock:
        if _init_state is not None:
            return _init_state
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        values = {k: os.environ.get(k) for k in names}
        present = [k for k, v in values.items() if v]
        if not present:
            _init_state = (0, 1)
            return _init_state
        if len(present) != len(names):
            missing = [k for k in names if k not in present]
            raise RuntimeError(f"jax_ep.launch.init_from_env: {', '.join(present)} set but {', '.join(missing)} "
                               f"not; set all three (python -m jax_ep.launch does) or none")
        try:
            num_processes = int(values[ENV_NUM_PROCESSES])
            process_id = int(values[ENV_PROCESS_ID])
        except ValueError as e:
            raise RuntimeError(f"jax_ep.launch.init_from_env: bad {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}: {e}") from None
        if not (num_processes >= 1 and 0 <= process_id < num_processes):
            raise RuntimeError(f"jax_ep.launch.init_from_env: {ENV_PROCESS_ID}={process_id} not in "
                               f"[0, {ENV_NUM_PROCESSES}={num_processes})")
        import jax

        if jax.distributed.is_initialized():
            # Someone (the user script) already joined; accept it if it agrees with the environment.
            got = (jax.process_index(), jax.process_count())
            if got != (process_id, num_processes):
                raise RuntimeError(f"jax_ep.launch.init_from_env: jax.distributed already initialized as "
                                   f"process {got[0]} of {got[1]}, environment says {process_id} of "
                                   f"{num_processes}")
            _init_state = got
            return _init_state
        if num_processes > 1:
            impl = getattr(jax.config, "jax_cpu_collectives_implementation", None)
            if impl in (None, "", "none"):
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption service installs a SIGTERM handler (the process then survives SIGTERM); under the
        # launcher SIGTERM means "another rank failed, stop now", so it is turned off unless the user set it.
        if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ and hasattr(jax.config, "jax_enable_preemption_service"):
            jax.config.update("jax_enable_preemption_service", False)
        jax.distributed.initialize(coordinator_address=values[ENV_COORDINATOR], num_processes=num_processes,
                                   process_id=process_id, **initialize_kwargs)
        _init_state = (process_id, num_processes)
        return _init_state


# ---------------------------------------------------------------------------------------------------------
# launcher side
# ---------------------------------------------------------------------------------------------------------
_VALUE_OPTIONS = {"-n", "--nproc", "--num-processes", "--gpus-per-process", "--grace-seconds", "--timeout",
                  "--port"}

USAGE = ("python -m jax_ep.launch -n N [--gpus-per-process K] [--no-gpu-pinning] [--timeout SECONDS] "
         "[--grace-seconds SECONDS] [--port PORT] (script.py | -m module) [args ...]")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.launch", usage=USAGE,
        description="Start N processes of a JAX program on this host (one GPU each, coordinator on loopback); "
                    "stream their output prefixed with '[rank i] '; if one fails, stop the others and exit "
                    "with its code. Launcher options come before the script (or -m module); everything after "
                    "it is passed to the program.")
    p.add_argument("-n", "--nproc", "--num-processes", dest="nproc", type=int, required=True,
                   help="number of processes (>= 1; on a GPU machine at most visible GPUs / --gpus-per-process)")
    p.add_argument("--gpus-per-process", type=int, default=1,
                   help="GPUs given to each process through CUDA_VISIBLE_DEVICES (default 1)")
    p.add_argument("--no-gpu-pinning", action="store_true",
                   help="do not set CUDA_VISIBLE_DEVICES (CPU runs, or to manage devices yourself)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help=f"kill every process after this long and exit {TIMEOUT_EXIT_CODE}")
    p.add_argument("--grace-seconds", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, wait this long before SIGKILL (default 10)")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port on 127.0.0.1 (default: a free one)")
    return p


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, command): the command starts at the first non-option word, at `-m`, or after `--`."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i], argv[i + 1:]
        if tok == "-m" or (tok.startswith("-m") and not tok.startswith("--")):
            mod = argv[i + 1:] if tok == "-m" else [tok[2:]] + argv[i + 1:]
            return argv[:i], ["-m"] + mod
        if not tok.startswith("-") or tok == "-":
            return argv[:i], argv[i:]
        i += 2 if tok in _VALUE_OPTIONS else 1
    return argv, []


def _visible_gpus() -> list[str] | None:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries; None when the machine has no NVIDIA GPU."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        entries = [e.strip() for e in cvd.split(",") if e.strip()]
        # CUDA stops at the first invalid entry ("-1" is the usual way to hide every GPU).
        out = []
        for e in entries:
            if e.startswith("-"):
                break
            out.append(e)
        return out or None  # set but empty (or "-1"): the user hid every GPU, treat as a CPU machine
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                n = sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))
                if n:
                    return [str(i) for i in range(n)]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
        if n:
            return [str(i) for i in range(n)]
    except OSError:
        pass
    return None


def _free_port() -> int:
    """A TCP port free on every interface now (the coordinator binds all interfaces on it)."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6:
                    s6.bind(("::", port))
            except OSError as e:
                if e.errno in (98, 48):  # EADDRINUSE on Linux / macOS
                    continue
        return port
    raise RuntimeError("jax_ep.launch: no free port found")


class _Child:
    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank = rank
        self.proc = proc
        self.pgid = proc.pid  # start_new_session=True: the child leads its own process group
        self.threads: list[threading.Thread] = []
        self.eof: list[float] = []  # when each output pipe closed (the child's fds close when it dies)
        self.reaped: float | None = None

    def death_time(self) -> float:
        """Best estimate of when the child died: its output pipes close while it exits (together with its
        sockets, so before any peer can notice), while reaping a big multi-threaded process can take longer."""
        # Both are observed late (by a thread that has to be scheduled): take the earlier observation.
        seen = [t for t in (max(self.eof) if self.eof and len(self.eof) == len(self.threads) else None,
                            self.reaped) if t is not None]
        return min(seen) if seen else time.monotonic()


def _pump(stream, out, rank: int, lock: threading.Lock, eof: list) -> None:
    """Copy one child stream to `out` line by line, each line prefixed with `[rank i] `."""
    prefix = f"[rank {rank}] ".encode()
    binary = getattr(out, "buffer", None)
    try:
        for line in iter(stream.readline, b""):
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


def _make_die_with_parent():
    """preexec_fn (Linux) so a child gets SIGKILL if the launcher dies, even by SIGKILL; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: the child only calls it
    except (OSError, AttributeError):
        return None
    sigkill = int(signal.SIGKILL)

    def die_with_parent():
        prctl(1, sigkill)  # PR_SET_PDEATHSIG

    return die_with_parent


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 + (-code) if code < 0 else code


class _Launcher:
    def __init__(self, args, command: list[str]):
        self.args = args
        self.command = command
        self.children: list[_Child] = []
        self.lock = threading.Lock()          # serializes writes to the parent's stdout/stderr
        self.exits: queue.Queue = queue.Queue()  # (rank, code) in the order the children exited
        self.codes: dict[int, int] = {}
        self.interrupted: int | None = None
        self.stop_time: float | None = None  # when the launcher sent SIGTERM

    def log(self, msg: str) -> None:
        with self.lock:
            try:
                sys.stderr.write(_PREFIX + msg + "\n")
                sys.stderr.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass

    def _on_signal(self, signum, frame):
        if self.interrupted is None:
            self.interrupted = signum

    def _waiter(self, c: _Child) -> None:
        code = c.proc.wait()
        c.reaped = time.monotonic()
        self.exits.put((c.rank, code))

    def _running(self) -> list[int]:
        return [c.rank for c in self.children if c.proc.poll() is None]

    # -- process groups -----------------------------------------------------------------------------------
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
        deadline = time.monotonic() + max(self.args.grace_seconds, 0.0)
        while time.monotonic() < deadline and self._running():
            time.sleep(0.02)
        left = self._running()
        if left:
            self.log(f"ranks {left} still running {self.args.grace_seconds:g} s after SIGTERM; sending SIGKILL")
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

    def _report(self) -> None:
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
                parts.append(f"rank {c.rank}: {_describe(code)}" + (" while being stopped" if after else ""))
        self.log("; ".join(parts))

    def _first_failure(self) -> tuple[int, int]:
        """The failed rank that died first (of those that died before the launcher stopped the others)."""
        failed = [c for c in self.children if c.proc.poll() not in (None, 0)]
        own = [c for c in failed if self.stop_time is None or c.death_time() < self.stop_time] or failed
        c = min(own, key=lambda c: (c.death_time(), c.rank))
        return c.rank, c.proc.returncode

    # -- main ---------------------------------------------------------------------------------------------
    def child_envs(self) -> list[dict[str, str]]:
        a = self.args
        port = a.port if a.port else _free_port()
        base = dict(os.environ)
        for k, v in FORCED_ENV.items():
            if base.get(k, v) != v:
                self.log(f"overriding {k}={base[k]} with {k}={v} (NVLink multicast must stay off)")
            base[k] = v
        for k, v in DEFAULT_ENV.items():
            base.setdefault(k, v)
        base[ENV_COORDINATOR] = f"127.0.0.1:{port}"
        base[ENV_NUM_PROCESSES] = str(a.nproc)
        gpus = None if a.no_gpu_pinning else _visible_gpus()
        envs = []
        for i in range(a.nproc):
            env = dict(base)
            env[ENV_PROCESS_ID] = str(i)
            if gpus:
                k = a.gpus_per_process
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * k:(i + 1) * k])
            envs.append(env)
        return envs

    def run(self) -> int:
        envs = self.child_envs()
        if self.command[0] == "-m":
            target = ["-m", self.command[1]] + self.command[2:]
        else:
            target = ["script"] + self.command
        argv = [sys.executable, "-u", "-c", CHILD_BOOTSTRAP] + target
        old_handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # not the main thread
                pass
        start = time.monotonic()
        try:
            # Every child is started before any thread (preexec_fn and threads do not mix); the pipes hold what
            # they print meanwhile.
            preexec = _make_die_with_parent()
            for i, env in enumerate(envs):
                if self.interrupted is not None:
                    break
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)
                self.children.append(_Child(i, proc))
            for c in self.children:
                for stream, out in ((c.proc.stdout, sys.stdout), (c.proc.stderr, sys.stderr)):
                    t = threading.Thread(target=_pump, args=(stream, out, c.rank, self.lock, c.eof),
                                         daemon=True)
                    t.start()
                    c.threads.append(t)
                threading.Thread(target=self._waiter, args=(c,), daemon=True).start()
            return self._wait(start)
        except BaseException:
            self._stop_all()
            raise
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)

    def _wait(self, start: float) -> int:
        a = self.args
        deadline = None if a.timeout is None else start + a.timeout
        while True:
            if self.interrupted is not None:
                name = signal.Signals(self.interrupted).name
                self.log(f"received {name}; stopping all {len(self.children)} ranks")
                self._stop_all()
                self._join_output()
                self._report()
                return 128 + int(self.interrupted)
            try:
                rank, code = self.exits.get(timeout=0.05)
            except queue.Empty:
                rank = code = None
            if rank is not None:
                self.codes[rank] = code
                if code != 0:
                    others = self._running()
                    self.log(f"rank {rank} {_describe(code)}"
                             + (f"; stopping ranks {others}" if others else ""))
                    self._stop_all()
                    self._join_output()
                    self._report()
                    rank, code = self._first_failure()
                    self.log(f"rank {rank} failed first ({_describe(code)}); exiting with code {_exit_code(code)}")
                    return _exit_code(code)
                if len(self.codes) == len(self.children) == a.nproc:
                    self._join_output()
                    self._signal_groups(signal.SIGKILL, only_running=False)  # leftover grandchildren, if any
                    return 0
            if deadline is not None and time.monotonic() >= deadline:
                running = self._running()
                self.log(f"timeout: {a.timeout:g} s elapsed with ranks {running} still running; "
                         f"stopping all ranks and exiting with code {TIMEOUT_EXIT_CODE}")
                self._stop_all()
                self._join_output()
                self._report()
                self.log(f"timed out after {a.timeout:g} s; exiting with code {TIMEOUT_EXIT_CODE}")
                return TIMEOUT_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    opts, command = _split_argv(argv)
    args = parser.parse_args(opts)
    if args.nproc < 1:
        parser.error(f"-n must be >= 1, got {args.nproc}")
    if args.gpus_per_process < 1:
        parser.error(f"--gpus-per-process must be >= 1, got {args.gpus_per_process}")
    if args.grace_seconds < 0:
        parser.error(f"--grace-seconds must be >= 0, got {args.grace_seconds:g}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout:g}")
    if args.port is not None and not (0 < args.port < 65536):
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if not command:
        parser.error("missing the program to run: give script.py [args...] or -m module [args...] after the "
                     "launcher options")
    if command[0] == "-m" and (len(command) < 2 or not command[1]):
        parser.error("-m needs a module name")
    if command[0] != "-m" and not os.path.isfile(command[0]):
        parser.error(f"script not found: {command[0]}")
    if not args.no_gpu_pinning:
        gpus = _visible_gpus()
        if gpus is not None:
            need = args.nproc * args.gpus_per_process
            if need > len(gpus):
                src = ("CUDA_VISIBLE_DEVICES=" + os.environ["CUDA_VISIBLE_DEVICES"]
                       if "CUDA_VISIBLE_DEVICES" in os.environ else "nvidia-smi")
                parser.error(f"-n {args.nproc} with --gpus-per-process {args.gpus_per_process} needs {need} GPUs "
                             f"but {len(gpus)} are visible ({src}); lower -n or pass --no-gpu-pinning")
    return _Launcher(args, command).run()


if __name__ == "__main__":
    sys.exit(main())
