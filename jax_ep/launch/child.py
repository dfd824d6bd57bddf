"""Child-side bootstrap: what every process started by the launcher runs.

    python -u -m jax_ep.launch.child [--no-join] (script.py | -m module) [args ...]

1. Joins the job (`init_from_env`: jax.distributed.initialize from the launcher's JAX_EP_* variables), so an
   unchanged JAX script becomes one process of one job; `--no-join` leaves that to the program.
2. Runs the program like `python script.py` / `python -m module` would: runpy, sys.argv, sys.path[0],
   `__name__ == "__main__"`.
3. On failure (an uncaught exception, a non-zero SystemExit, or a failed join) first notes the failure for the
   launcher, before this process tears anything down (failures.note: how the launcher tells the rank that failed
   on its own from the ranks that lost it), and ignores SIGTERM from then on (the launcher's "another rank failed"
   signal must not cut its traceback short nor replace its exit code; the launcher's SIGKILL after --grace-seconds
   still bounds its exit). Then it prints the traceback as Python would,
   flushes stdout/stderr and logging, and leaves with os._exit(code), skipping atexit hooks. Why: after
   jax.distributed.initialize, JAX's exit hook waits in a shutdown barrier for every other process (300 s by
   default), so a rank that failed while the others sit in a collective would never exit and the launcher could
   not see the failure. A program that succeeds exits normally (its atexit hooks and the barrier run).

This module imports JAX only when joining, after the launcher's environment is in place, and nothing of jax_ep
but jax_ep.launch.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback

USAGE = "usage: python -m jax_ep.launch.child [--no-join] (script.py | -m module) [args ...]"


def _exit_code(e: SystemExit) -> int:
    """The process exit code of a failing SystemExit (prints a non-integer code like Python)."""
    if isinstance(e.code, int):
        return e.code & 0xFF or 1
    try:
        print(e.code, file=sys.stderr)
    except Exception:
        pass
    return 1


def _print_exception(e: BaseException) -> None:
    """Print `e` as Python's top level would, without this bootstrap's and runpy's frames."""
    here = os.path.abspath(__file__)
    tb = e.__traceback__
    while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) == here
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    try:
        e.__traceback__ = tb
        sys.excepthook(type(e), e, tb)
    except Exception:
        traceback.print_exception(type(e), e, tb)


def _join() -> None:
    from jax_ep.launch.env import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
    from jax_ep.launch.join import init_from_env

    try:
        init_from_env()
    except BaseException:
        env = os.environ
        print(f"jax_ep.launch: process {env.get(ENV_PROCESS_ID)} of {env.get(ENV_NUM_PROCESSES)} could not join "
              f"the job at {env.get(ENV_COORDINATOR)}:", file=sys.stderr, flush=True)
        raise


def _die_with_launcher() -> None:
    """SIGKILL this process when the launcher dies (Linux PR_SET_PDEATHSIG), set here rather than between fork and
    exec in the launcher; if the launcher is already gone (it died before this line), exit now."""
    from jax_ep.launch.env import ENV_LAUNCHER_PID

    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):
        _leave(1)


def _failure_record() -> tuple[int, int, int] | None:
    """(descriptor, local rank, local ranks) for failures.note, from env.ENV_FAILURE_FILE; None when not started by
    the launcher. Removes the variable and keeps the descriptor from the program's own subprocesses."""
    from jax_ep.launch.env import ENV_FAILURE_FILE

    try:
        fd, i, n = (int(x) for x in os.environ.pop(ENV_FAILURE_FILE).split(":"))
        os.set_inheritable(fd, False)
    except (KeyError, ValueError, OSError):
        return None
    return fd, i, n


def _note_failure(record: tuple[int, int, int] | None) -> None:
    """The program failed: ignore SIGTERM from now on and note the failure for the launcher (module docstring, 3.)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if record is not None:
        from jax_ep.launch import failures

        failures.note(*record)


def _run_program(mode: str, target: str, args: list[str]) -> None:
    sys.argv = [target] + args
    if mode == "-m":
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def _leave(code: int) -> None:
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


def main(argv: list[str] | None = None) -> None:
    """Join, run the program; returns when it succeeded, never returns when it failed (os._exit)."""
    _die_with_launcher()
    record = _failure_record()
    argv = list(sys.argv[1:] if argv is None else argv)
    join = True
    if argv[:1] == ["--no-join"]:
        join, argv = False, argv[1:]
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr, flush=True)
        _leave(2)
    mode, target, args = ("-m", argv[1], argv[2:]) if argv[0] == "-m" else ("script", argv[0], argv[1:])
    try:
        if join:
            _join()
        _run_program(mode, target, args)
        return
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return
        _note_failure(record)
        code = _exit_code(e)
    except BaseException as e:
        _note_failure(record)
        _print_exception(e)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    _leave(code)


if __name__ == "__main__":
    main()
