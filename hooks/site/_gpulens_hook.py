"""Arming logic behind the trainer hook (standard library only; imported by sitecustomize).

What it does (see docs/ARCHITECTURE.md, "The trainer hook"):
1. at interpreter start, in every process: KINETO_USE_DAEMON=1 and, when configured,
   KINETO_IPC_SOCKET_DIR / KINETO_ONDEMAND_TRACE_DIR; a Kineto job id distinct per pod
   (SLURM_JOB_ID, the only job id Kineto reads) unless the process already runs under Slurm;
2. registers the process that actually trains, decided by what it does, never by its argv:
   - when `torch.distributed.init_process_group` returns, with the rank and world size the
     process group reports (identity `process_group`);
   - failing that, once it has imported torch, as a single-process job (identity
     `single_process`, ranks from the environment, else 0 of 1) -- unless it is a
     multiprocessing child (spawn/forkserver preparation, or a started Process), whose parent is
     the job;
   a registration by a descendant removes an ancestor's `single_process` record, so a launcher
   (torchrun, accelerate, deepspeed, a self-relaunching script) that imported torch is gone from
   the registry as soon as its workers appear, and a `multiprocessing.spawn` parent once its
   children form their process group;
3. removes the record at exit and on SIGTERM/SIGINT (chaining the trainer's handlers).
A process that never imports torch never registers and pays only the start-up cost.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import zlib

from _gpulens_flight import FlightListener, flight_socket_name
from _gpulens_imports import AfterImport
from _gpulens_record import (IDENTITY_PROCESS_GROUP, IDENTITY_SINGLE_PROCESS, SCHEMA_VERSION, RegistryWriteError,
                             build_record, pid_namespace, record_filename, remove_quietly, write_atomically)
from _gpulens_signals import ExitSignals
from _gpulens_steps import StepPublisher, steps_filename

__all__ = ["arm", "main", "Registrar", "kineto_job_id", "build_record", "record_filename", "write_atomically",
           "RegistryWriteError", "SCHEMA_VERSION", "chain_sitecustomize", "in_multiprocessing_child"]

FALLBACK_ENV = "GPULENS_FALLBACK_RECORD"   # an ancestor's single_process record, for a descendant to retire
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _cmdline() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return list(getattr(sys, "argv", []) or [])


def kineto_job_id(identity_key: str) -> int:
    """A positive int32 job id derived from the pod (dynolog parses job ids as C int)."""
    return (zlib.crc32(identity_key.encode()) & 0x7FFFFFFF) or 1


def in_multiprocessing_child() -> bool:
    """True inside a process that `multiprocessing` started (its parent is the job), judged from
    the interpreter's state and stack, not from argv: spawn/forkserver preparation marks the
    current process `_inheriting`; a started Process has a parent_process()."""
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        current = mp_process.current_process()
        if getattr(current, "_inheriting", False) or mp_process.parent_process() is not None:
            return True
    mp = sys.modules.get("multiprocessing")
    if mp is None or not getattr(mp, "__file__", None):
        return False  # spawn and forkserver children always have it
    helpers = {os.path.join(os.path.dirname(mp.__file__), f) for f in ("forkserver.py", "spawn.py", "resource_tracker.py")}
    frame = sys._getframe(1)
    while frame is not None:  # the forkserver server preloading modules, a spawn child before bootstrap
        if frame.f_code.co_filename in helpers:
            return True
        frame = frame.f_back
    return False


class Registrar:
    """This process's registration: at most one record, replaced when the identity improves."""

    def __init__(self, env, registry: str, cmdline: list[str], *, stderr=None):
        self.env, self.registry, self.cmdline = env, registry, cmdline
        self.stderr = stderr
        self.path: str | None = None
        self.pid: int | None = None
        self.identity: str | None = None
        self.warned = False
        self.signals = ExitSignals(self.remove)
        self._atexit = False
        self.steps: StepPublisher | None = None
        self.flight: FlightListener | None = None

    # the two moments -------------------------------------------------------------------------

    def on_torch_imported(self, _module=None) -> None:
        if self.path is not None and self.pid == os.getpid():
            return
        if in_multiprocessing_child():
            return
        self.register(identity=IDENTITY_SINGLE_PROCESS)

    def on_process_group(self, rank: int, world_size: int) -> None:
        self.register(identity=IDENTITY_PROCESS_GROUP, rank=rank, world_size=world_size)

    # mechanics -------------------------------------------------------------------------------

    def register(self, *, identity: str, rank: int | None = None, world_size: int | None = None) -> str | None:
        pid = os.getpid()
        env = dict(self.env)
        if rank is not None:
            env["RANK"], env["WORLD_SIZE"] = str(rank), str(world_size)
            env.setdefault("LOCAL_RANK", str(rank))           # no launcher told us: one node
            env.setdefault("LOCAL_WORLD_SIZE", str(world_size))
        rec = build_record(env, pid, self.cmdline, time.time(), identity=identity)
        name = record_filename(rec)
        if self._steps_possible():   # named before the write; made only once the record is on disk
            rec["steps_file"] = steps_filename(rec["pid_namespace"], pid)
        if identity == IDENTITY_PROCESS_GROUP and rec.get("socket_dir"):
            listening = self._listen_for_flight(rec)   # before the write: a named socket already answers
            if listening:
                rec["flight_socket"] = listening
        try:
            path = write_atomically(self.registry, name, rec)
        except RegistryWriteError as exc:
            self._warn(f"rank {rec['global_rank']} (pid {pid}) is not registered, so it cannot be captured: {exc}; "
                       f"Kineto daemon mode stays on and training runs on")
            return None
        if "steps_file" in rec:
            self._publish_steps(rec)
        mine = self.path if self.pid == pid else None
        if mine and mine != path:
            remove_quietly(mine)                      # our earlier identity (e.g. single_process -> rank 3)
        self._retire_ancestor(path)
        self.path, self.pid, self.identity = path, pid, identity
        if identity == IDENTITY_SINGLE_PROCESS:
            self.env[FALLBACK_ENV] = path             # descendants that train retire it
        else:
            self.env.pop(FALLBACK_ENV, None)          # a real worker is never retired by a child
        if not self._atexit:
            atexit.register(self.remove)
            self._atexit = True
        self.signals.install()
        return path

    def _listen_for_flight(self, rec: dict) -> str | None:
        """This rank's Flight Recorder listener (once per process): the socket's name, or None."""
        name = flight_socket_name(rec["pid_namespace"], rec["pid"])
        if self.flight is not None and self.flight.pid == rec["pid"]:
            return name
        listener = FlightListener(rec["socket_dir"], rec["trace_dir"])
        if listener.start(name) is None:
            return None              # the dump is lost to captures, never the registration
        self.flight = listener
        return name

    @staticmethod
    def _steps_possible() -> bool:
        profiler = sys.modules.get("torch.autograd.profiler")
        return (hasattr(getattr(profiler, "KinetoStepTracker", None), "_current_step")
                and hasattr(sys.modules.get("torch.optim.optimizer"), "register_optimizer_step_post_hook"))

    def _publish_steps(self, rec: dict) -> StepPublisher | None:
        """This process's step file and optimizer post-hook, made once per process, only when
        torch's optimizer and step tracker are loaded (never imported here). A failure costs the
        absolute start iteration, never the registration."""
        if self.steps is not None and self.steps.pid == rec["pid"]:
            return self.steps
        optim = sys.modules.get("torch.optim.optimizer")
        profiler = sys.modules.get("torch.autograd.profiler")
        tracker = getattr(profiler, "KinetoStepTracker", None)
        register = getattr(optim, "register_optimizer_step_post_hook", None)
        if tracker is None or register is None or not hasattr(tracker, "_current_step"):
            return None
        try:
            steps = StepPublisher(os.path.join(self.registry, steps_filename(rec["pid_namespace"], rec["pid"])), tracker)
        except (OSError, ValueError) as exc:
            self._warn(f"step count not published (captures of rank {rec['global_rank']} cannot start on one "
                       f"iteration): {exc}")
            return None
        steps.handle = register(steps.on_step)
        self.steps = steps
        return steps

    def _retire_ancestor(self, own: str) -> None:
        inherited = self.env.get(FALLBACK_ENV, "")
        if not inherited or inherited == own:
            return
        # only a record file directly in our registry folder, never a path someone put in the env
        name = os.path.basename(inherited)
        if os.path.dirname(os.path.abspath(inherited)) == os.path.abspath(self.registry) and name.endswith(".json") \
                and not name.startswith("."):
            remove_quietly(inherited)

    def remove(self) -> None:
        if self.pid == os.getpid():  # a forked child inherits atexit and signal handlers; only the writer removes
            remove_quietly(self.path)
            self.path = None
            if self.steps is not None and self.steps.pid == os.getpid():
                self.steps.close()
            if self.flight is not None:
                self.flight.close()

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            print(f"gpulens-hook: {message}", file=self.stderr or sys.stderr, flush=True)


def _wrap_init_process_group(c10d, registrar: Registrar) -> None:
    original = getattr(c10d, "init_process_group", None)
    if original is None or getattr(original, "__gpulens_wrapped__", False):
        return
    import functools

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            registrar.on_process_group(int(c10d.get_rank()), int(c10d.get_world_size()))
        except Exception as exc:  # noqa: BLE001 - never break training
            registrar._warn(f"not registered after init_process_group: {type(exc).__name__}: {exc}")
        return result

    init_process_group.__gpulens_wrapped__ = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group


def set_kineto_env(env) -> None:
    env["KINETO_USE_DAEMON"] = "1"
    if env.get("GPULENS_SOCKET_DIR"):
        env["KINETO_IPC_SOCKET_DIR"] = env["GPULENS_SOCKET_DIR"]
    if env.get("GPULENS_TRACE_DIR"):
        env["KINETO_ONDEMAND_TRACE_DIR"] = env["GPULENS_TRACE_DIR"]
    if not env.get("SLURM_JOB_ID") and env.get("GPULENS_KINETO_JOB_ID", "auto") == "auto":
        # the same value in the launcher and its workers (same pod, pid namespace, job, attempt);
        # requests always name explicit pids, so only registered workers are ever asked to trace
        key = "|".join([env.get("GPULENS_POD_UID") or env.get("POD_UID") or socket.gethostname(), pid_namespace(),
                        env.get("GPULENS_JOB_ID", ""), env.get("GPULENS_ATTEMPT", "0")])
        env["SLURM_JOB_ID"] = str(kineto_job_id(key))


def arm(env=None, *, cmdline: list[str] | None = None, watch: bool = True) -> Registrar | None:
    """Arm this process: Kineto's environment now, registration when torch shows what it is.

    Returns the Registrar (None when disabled or without GPULENS_REGISTRY_DIR). With `watch`, the
    post-import gpulens.hooks for torch are installed on sys.meta_path.
    """
    env = os.environ if env is None else env
    if env.get("GPULENS_HOOK_DISABLE", "") not in ("", "0"):
        return None
    set_kineto_env(env)
    registry = env.get("GPULENS_REGISTRY_DIR")
    if not registry:
        return None
    registrar = Registrar(env, registry, _cmdline() if cmdline is None else cmdline)
    if watch:
        AfterImport({
            "torch.distributed.distributed_c10d": lambda m: _guarded(registrar, _wrap_init_process_group, m, registrar),
            "torch": lambda m: _guarded(registrar, registrar.on_torch_imported, m),
        }).install()
    return registrar


def _guarded(registrar: Registrar, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - an import of torch must never fail because of us
        registrar._warn(f"not registered: {type(exc).__name__}: {exc}")


def main() -> None:
    arm()


def chain_sitecustomize(our_file: str) -> None:
    """Run the next `sitecustomize` on sys.path (the trainer image's own), if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(our_file))
    rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.origin is None or os.path.abspath(spec.origin) == os.path.abspath(our_file):
        return
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        sys.modules["_gpulens_chained_sitecustomize"] = module
    except Exception as exc:
        print(f"gpulens-hook: chained sitecustomize {spec.origin} failed: {exc}", file=sys.stderr)
