"""Loaded by every Python process that `fpdoctor run` starts: its directory is first on PYTHONPATH.

Cheap and silent. It never raises, never writes to the process's own streams, never imports
torch, and chains to the sitecustomize the environment already had. Per process it leaves in
$FPDOCTOR_RUN_DIR (file names shared with fpdoctor.crash.collect):

- proc.<pid>.json  who it is (pid, ppid, argv, rank, host, visible GPUs), written at start
- fault.<pid>      faulthandler's dump when it dies of SIGSEGV, SIGFPE, SIGABRT, SIGBUS or SIGILL
- term.<pid>       every thread's stack when it is terminated (SIGTERM: torchrun stopping the
                   ranks that survived another's death), dumped before the default action kills it
- exc.<pid>.json   uncaught exceptions with their tracebacks (main thread and other threads)
- exit.<pid>.json  written when the interpreter shuts down normally (absent after a signal or os._exit)

Every interpreter a command starts runs this file, so it imports only what Python has loaded
already or what costs well under a millisecond (json would pull in `re`: ~7 ms per process),
and keeps to syntax that Python 3.7 parses.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import TracebackType
    from typing import Any, TextIO

_state: dict[str, Any] = {}
_RANK_KEY = "FPDOCTOR_RUN_RANK"  # pid:job of the rank whose environment a process inherited
# JSON string escapes (RFC 8259): quote, backslash and control characters
_ESCAPES = {**{i: f"\\u{i:04x}" for i in range(32)}, ord('"'): '\\"', ord("\\"): "\\\\"}


def _json(value: Any) -> str:
    """Standard JSON for the plain values a record holds, without importing json."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        finite = value - value == 0  # False for NaN and the infinities, which JSON cannot hold
        return repr(value) if finite else "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_json(str(k))}: {_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_json(v) for v in value) + "]"
    return '"' + str(value).translate(_ESCAPES) + '"'


def _write_json(path: str, record: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as fh:
        fh.write(_json(record))
    os.replace(tmp, path)  # a reader sees the old record or the new one, never half of one


def _argv() -> list[str]:
    argv = getattr(sys, "orig_argv", None) or getattr(sys, "argv", None) or []
    return [str(a)[:500] for a in argv[:64]]


def _start_process(run_dir: str, forked: bool) -> None:
    """Per-process files and the process record; run at start and again in a forked child."""
    import faulthandler
    import time

    pid = os.getpid()
    mode = _state.get("faulthandler")
    if mode is None:
        # A user who set PYTHONFAULTHANDLER or -X faulthandler keeps the dump on stderr, where
        # fpdoctor reads it back from the captured stream.
        mode = _state["faulthandler"] = "stderr" if faulthandler.is_enabled() else "file"
    if mode == "file":
        # faulthandler writes through the descriptor from its signal handler: it stays open for
        # the life of the process (a forked child gets a file of its own).
        fault = _open_above_stdio(os.path.join(run_dir, f"fault.{pid}"))
        faulthandler.enable(file=fault, all_threads=True)
        _swap("fault", fault)
    term_dump = _register_term_dump(run_dir, pid, forked)
    env = os.environ
    record: dict[str, Any] = {
        "pid": pid,
        "ppid": os.getppid(),
        "argv": _argv(),
        "executable": sys.executable,
        "python": ".".join(str(v) for v in sys.version_info[:3]),
        "start": time.time(),
        "host": os.uname()[1] if hasattr(os, "uname") else env.get("COMPUTERNAME", ""),
        "forked": forked,
        "faulthandler": mode,
        "term_dump": term_dump,
    }
    for key in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "CUDA_VISIBLE_DEVICES",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        if key in env:
            record[key.lower()] = env[key]
    if "RANK" in env and not forked:
        _claim_rank(record, pid)
    _write_json(os.path.join(run_dir, f"proc.{pid}.json"), record)


def _open_above_stdio(path: str) -> TextIO:
    """A file that stays open for the life of the process, never on descriptor 0, 1 or 2: in a
    program started with a closed stdout (`>&-`) it would take descriptor 1, and the program's
    writes there would land in it instead of failing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    if fd < 3:
        import fcntl

        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
        os.close(fd)
        fd = high
    return os.fdopen(fd, "w")


def _claim_rank(record: dict[str, Any], pid: int) -> None:
    """Only the launcher's own processes are ranks. A process started below a rank (a shell
    running `python -c 'import apex'`, a spawned worker) inherits RANK with the rest of the
    environment: the first process of a job with that RANK leaves its pid in the environment,
    and one that finds it there under the same job's RANK is that rank's helper."""
    job = "|".join(os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    owner, _, owned = os.environ.get(_RANK_KEY, "").partition(":")
    if owner.isdigit() and owned == job and int(owner) != pid:
        record["rank_of"] = int(owner)
    else:
        os.environ[_RANK_KEY] = f"{pid}:{job}"


def _swap(key: str, new: TextIO) -> None:
    old = _state.get(key)
    _state[key] = new
    if old is not None:
        old.close()  # a forked child's copy of its parent's descriptor


def _register_term_dump(run_dir: str, pid: int, forked: bool) -> bool:
    """Dump every thread's stack when SIGTERM arrives, then let it kill the process as before;
    True where the dump is armed.

    Only where SIGTERM still has its default action: a program that handles SIGTERM itself
    (or ignores it) keeps exactly its own behaviour, and a handler it installs later replaces
    this one. chain=True re-raises the signal under the default action, so the exit status
    stays 'killed by SIGTERM'.

    A forked child inherits the disposition its parent had at the fork. Only the file changes:
    faulthandler.register on a signal it holds already swaps the file and leaves the OS-level
    handler alone, whereas unregister would restore the SIG_DFL saved at start over a handler
    (or SIG_IGN) the program installed since. getsignal cannot see faulthandler's handler (it
    still answers SIG_DFL), but it does see one the program set through `signal`.
    """
    import _signal  # type: ignore[import-not-found]  # C module; `signal` imports enum (~5 ms a process)
    import faulthandler

    if not hasattr(faulthandler, "register") or not hasattr(_signal, "SIGTERM"):
        return False
    if forked and _state.get("term") is None:
        return False
    if _signal.getsignal(_signal.SIGTERM) != _signal.SIG_DFL:
        return False  # the program's own, set at start or since: a forked child keeps it as inherited
    term = _open_above_stdio(os.path.join(run_dir, f"term.{pid}"))
    faulthandler.register(_signal.SIGTERM, file=term, all_threads=True, chain=True)
    _swap("term", term)
    return True


def _exception_record(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None, thread: str | None
) -> dict[str, Any]:
    import time  # loaded at start (_start_process): no import runs here

    if issubclass(exc_type, KeyboardInterrupt) and "traceback" not in sys.modules:
        # An import while an uncaught KeyboardInterrupt is being handled makes CPython exit 1
        # instead of dying by SIGINT (the shell's 130): the frames are walked by hand instead.
        frames, text = _walk(tb), f"{exc_type.__name__}\n"
    else:
        import traceback

        frames = [{"file": f.filename, "line": f.lineno, "function": f.name} for f in traceback.extract_tb(tb)]
        text = "".join(traceback.format_exception(exc_type, exc, tb))
    record: dict[str, Any] = {
        "time": time.time(),
        "type": f"{getattr(exc_type, '__module__', 'builtins')}.{getattr(exc_type, '__qualname__', '?')}",
        "message": str(exc)[:4000],
        "traceback": text[-20000:],
        "frames": frames[-200:],
        "thread": thread,
    }
    child = _failed_child(exc_type, exc, tb)
    if child is not None:
        record["child"] = child
    return record


def _failed_child(exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None) -> Any:
    """The child a torch.multiprocessing launcher (mp.spawn, start_processes) reports as failed:
    ProcessRaisedException and ProcessExitedException carry its index and pid, and the
    ProcessContext that raised them (`self` of the innermost frame, its join) has every child's
    pid in index order: the index is what mp.spawn passes its function first, the process's rank."""
    index, pid = getattr(exc, "error_index", None), getattr(exc, "error_pid", None)
    if not str(getattr(exc_type, "__module__", "")).startswith("torch.") or not isinstance(index, int):
        return None
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    context_pids = getattr(tb.tb_frame.f_locals.get("self") if tb is not None else None, "pids", None)
    try:
        pids = [int(p) for p in context_pids()] if callable(context_pids) else []
    except Exception:  # another object's pids(): the failed child alone is named
        pids = []
    child: dict[str, Any] = {"index": index, "pid": pid, "pids": pids}
    # ProcessExitedException: how the child ended when it left no exception (SIGKILL, os._exit)
    signal_name, exit_code = getattr(exc, "signal_name", None), getattr(exc, "exit_code", None)
    if isinstance(signal_name, str):
        child["signal"] = signal_name
    elif isinstance(exit_code, int):
        child["exit_code"] = exit_code
    return child


def _walk(tb: TracebackType | None) -> list[dict[str, Any]]:
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append({"file": code.co_filename, "line": tb.tb_lineno, "function": code.co_name})
        tb = tb.tb_next
    return frames


def _save_exception(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None, thread: str | None
) -> None:
    run_dir = _state.get("run_dir")
    if not run_dir:
        return
    if thread is None:
        _state["shown"] = exc  # the interpreter's own: _at_exit need not record it again
    try:
        records = _state.setdefault("exceptions", [])
        if len(records) < 20:
            record = _exception_record(exc_type, exc, tb, thread)
            _explain_mismatch(record, exc)
            records.append(record)
            pid = os.getpid()
            _write_json(os.path.join(run_dir, f"exc.{pid}.json"), {"pid": pid, "exceptions": records})
    except Exception:  # the program's own hook runs next, whatever happens here
        pass


def _explain_mismatch(record: dict[str, Any], exc: BaseException | None) -> None:
    """A dtype or device mismatch explained from the live model while the traceback holds it
    (fpdoctor.crash.live): only for such a text in a process that imported torch."""
    message = record["message"]
    if exc is None or "torch" not in sys.modules or not any(w in message for w in ("dtype", "device", "type")):
        return
    try:
        with _own_package():
            from fpdoctor.crash import live

            explained = live.explain(exc)
        if explained:
            record["explained"] = explained
    except Exception:  # the exception is recorded as raised, unexplained
        pass


class _own_package:
    """fpdoctor imported from the copy that started this run, then sys.path as it was."""

    def __enter__(self) -> None:
        root = os.environ.get("FPDOCTOR_RUN_PKG") or ""
        self.added = bool(root) and root not in sys.path
        if self.added:
            sys.path.insert(0, root)
        self.root = root

    def __exit__(self, *exc: object) -> None:
        if self.added and self.root in sys.path:
            sys.path.remove(self.root)


def _install_hooks() -> None:
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        _save_exception(exc_type, exc, tb, None)
        previous(exc_type, exc, tb)

    if previous is sys.__excepthook__:
        # `sys.excepthook is sys.__excepthook__` stays true: code that asks whether a hook is
        # installed (the exceptiongroup backport on Python 3.10, PyQt, code.InteractiveConsole)
        # behaves as without fpdoctor, and a hook installed later that ends by calling
        # sys.__excepthook__ (apport's, most custom ones) still passes through this one.
        sys.__excepthook__ = excepthook
    sys.excepthook = excepthook
    import threading

    previous_thread_hook = threading.excepthook

    def thread_excepthook(args: Any) -> None:
        if args.exc_type is not SystemExit:
            name = getattr(args.thread, "name", None) if args.thread is not None else None
            _save_exception(args.exc_type, args.exc_value, args.exc_traceback, name or "?")
        previous_thread_hook(args)

    threading.excepthook = thread_excepthook


def _at_exit() -> None:
    run_dir = _state.get("run_dir")
    if not run_dir:
        return
    try:
        import time

        pid = os.getpid()
        # An uncaught exception shown by a hook installed later that did not pass it on: the
        # interpreter left it in sys.last_value (recorded now, at exit, rather than never).
        last = getattr(sys, "last_value", None)
        if isinstance(last, BaseException) and last is not _state.get("shown"):
            _save_exception(type(last), last, last.__traceback__, None)
        _write_json(os.path.join(run_dir, f"exit.{pid}.json"), {"pid": pid, "time": time.time()})
    except Exception:  # a full disk at exit must not change how the program exits
        pass


def _after_fork() -> None:
    try:
        _start_process(_state["run_dir"], forked=True)
        _state["exceptions"] = []
    except Exception:  # the forked child runs on, uninstrumented
        pass


def _arm_breadcrumbs(run_dir: str) -> None:
    """Load the op recorder from the fpdoctor that started this run (not whichever copy the
    command's environment may have installed), then leave sys.path as it was."""
    with _own_package():
        from fpdoctor.crash import breadcrumbs

        breadcrumbs.arm(run_dir)


def _setup() -> None:
    run_dir = os.environ.get("FPDOCTOR_RUN_DIR")
    if not run_dir or not os.path.isdir(run_dir):
        return
    _state["run_dir"] = run_dir
    _start_process(run_dir, forked=False)
    _install_hooks()
    import atexit

    atexit.register(_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)
    if os.environ.get("FPDOCTOR_RUN_BREADCRUMBS") == "1":
        _arm_breadcrumbs(run_dir)


def _chain() -> None:
    """Run the sitecustomize this one shadows (a distribution's, a virtual environment's,
    another tool's), as Python would have without fpdoctor, errors reported as site.py does."""
    try:
        # the import system's own modules, always loaded: importlib.util would cost an import
        bootstrap = sys.modules["_frozen_importlib"]
        external = sys.modules["_frozen_importlib_external"]
        here = os.path.dirname(os.path.abspath(__file__))
        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = external.PathFinder.find_spec("sitecustomize", rest)
    except Exception:
        return
    if spec is None or spec.loader is None:
        return
    module = bootstrap.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")


try:  # noqa: SIM105 - contextlib is not loaded this early and costs an import in every process
    _setup()
except Exception:  # the command runs as without fpdoctor; the report says it left no record
    pass
_chain()
