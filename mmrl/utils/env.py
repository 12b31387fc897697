"""Process environment for the engines: the same code selects CPU or CUDA settings."""
from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device


def engine_env(run_dir: str | os.PathLike, device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for vLLM / DeepSpeed processes. On CPU: a small KV cache, and
    caches and RPC sockets inside the run dir instead of ~/.cache and /tmp."""
    run = Path(run_dir).resolve()
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CACHE_ROOT": str(run / ".cache" / "vllm"),
        "VLLM_RPC_BASE_PATH": rpc_dir(run),
        "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
    }
    if "HF_HUB_OFFLINE" in os.environ:  # the driver's choice reaches every process
        env["HF_HUB_OFFLINE"] = os.environ["HF_HUB_OFFLINE"]
    if device == "cpu":
        env.update({"DS_ACCELERATOR": "cpu", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    env.update(extra or {})
    for key in ("VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    return env


# Ray 2.60 gives a starting node a fixed 30 s to register with its GCS (node.py; no setting), and
# on a loaded 2-core machine the raylet can take longer. The failed start leaves its GCS and
# raylet running with no owner: they are stopped before the next try.
RAY_START_ATTEMPTS = 3
RAY_WORKER_REGISTER_TIMEOUT_S = 600
RAY_START_TIMEOUT = "timed out during startup"


def init_local_ray(**ray_init_kwargs: object) -> None:
    """Start a local Ray instance for mmrl's actors, patient with a busy machine (see below).
    Ray starts worker processes at niceness 15
    by default (`RAY_worker_niceness`), which is right for a cluster where the driver must stay
    responsive but wrong here: every engine, trainer rank and reward worker is a Ray worker, so
    any ordinary process on the machine (a build, a browser, a second job) takes ~97% of the CPU
    from training. mmrl's workers run at normal priority unless the caller set the variable."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")
    # A worker process has 60 s to register by default; on a loaded 2-core machine importing
    # torch/vLLM can take longer, and the raylet then kills it and starts another (5 times, then
    # the actor is unschedulable), which only adds load. Wait for it instead.
    os.environ.setdefault("RAY_worker_register_timeout_seconds", str(RAY_WORKER_REGISTER_TIMEOUT_S))
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = ray_sessions()
        try:
            ray.init(**ray_init_kwargs)
            return
        except Exception as e:
            if RAY_START_TIMEOUT not in str(e) or attempt == RAY_START_ATTEMPTS:
                raise
            killed = kill_session_processes(ray_sessions() - before)
            print(f"[mmrl] Ray's node did not register within Ray's fixed 30 s start window (a busy machine); "
                  f"stopped the {killed} process(es) it had started, retrying ({attempt}/{RAY_START_ATTEMPTS - 1})",
                  file=sys.stderr)


def ray_sessions() -> set[str]:
    """Names of the Ray session folders on this machine (session_<date>_<pid>)."""
    from ray._common.utils import get_default_ray_temp_dir  # where ray.init puts them by default

    root = Path(os.environ.get("RAY_TMPDIR") or get_default_ray_temp_dir())
    return {p.name for p in root.glob("session_2*")} if root.is_dir() else set()


def kill_session_processes(sessions: set[str]) -> int:
    """SIGKILL this user's processes whose command line names one of `sessions`; how many."""
    import psutil

    if not sessions:
        return 0
    killed = 0
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            if proc.pid == os.getpid() or proc.info["uids"].real != os.getuid():
                continue
            if any(name in arg for arg in proc.info["cmdline"] or () for name in sessions):
                proc.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


STALE_BUILD_LOCK_S = 600.0  # DeepSpeed's CPU ops build in about a minute


def torch_extensions_dir() -> str:
    """Where DeepSpeed JIT-builds its CPU ops: one directory per Python environment (two venvs
    sharing one rebuild each other's ops, since their include paths differ), with stale build
    locks removed first: torch waits forever on the lock file of a build whose process was
    killed, and every later run would hang in DeepSpeed's init."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or str(environment_cache_dir("torch_extensions"))
    remove_stale_build_locks(base)
    return base


def environment_cache_dir(kind: str) -> Path:
    """~/.cache/mmrl/KIND/<digest of this Python environment>: a cache that every run of one
    environment shares, and that another environment (other library versions) does not touch."""
    return Path.home() / ".cache" / "mmrl" / kind / hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]


def remove_stale_build_locks(base: str | os.PathLike, max_age_s: float = STALE_BUILD_LOCK_S) -> list[str]:
    """Delete `*/lock` files under `base` older than `max_age_s` (a live build refreshes nothing,
    but finishes long before); returns what was removed."""
    removed = []
    for lock in Path(base).glob("*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                removed.append(str(lock))
                warnings.warn(f"removed a stale torch extension build lock {lock} (its build was interrupted)")
        except OSError:
            pass
    return removed


def rpc_dir(run_dir: str | os.PathLike) -> str:
    """A short per-run directory for vLLM's ZMQ IPC sockets. Socket paths are limited to 107
    bytes, which a socket name under a deep run directory easily exceeds."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return os.path.join(tempfile.gettempdir(), f"mmrl-rpc-{digest}")


def apply_env(env: dict[str, str]) -> None:
    os.environ.update(env)


def reread_vllm_env() -> None:
    """Make vLLM read its environment variables again. An engine core running in this process
    freezes them for the life of the process (`vllm.envs.enable_envs_cache`), so a second engine
    here (the serve's sampler after a judge reward, a test session) would bind its sockets under
    the first one's RPC folder, long removed. Call before starting an engine in-process."""
    import vllm.envs

    vllm.envs.disable_envs_cache()


# DeepSpeed's CPU shared-memory all-reduce (used when LOCAL_SIZE equals the world size) maps one
# ~66 MB buffer per rank, named {prefix}_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}
# (deepspeed/ops/csrc/cpu/comm/shm.cpp: shm_initialize), and never removes them.
ALLREDUCE_BUFFER_PREFIX = "deepspeed_allreduce_buffer"
SHM_DIR = Path("/dev/shm")


def allreduce_buffer_prefix(master_addr: str, master_port: int | str) -> str:
    """The name of the all-reduce buffers of the process group that met at master_addr:master_port,
    less the rank. The trailing '_' keeps port 123 from matching port 1234."""
    return f"{ALLREDUCE_BUFFER_PREFIX}_{os.getuid()}_{master_addr}_{master_port}_"


def cleanup_shm(master_addr: str | None = None, master_port: int | None = None, *, orphans: bool = True,
                shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove this run's DeepSpeed all-reduce buffers: those of its ranks' process group
    (master_addr:master_port; the ranks are stopped or stopping, and a file unlinked while mapped
    is freed when they exit). With `orphans`, also this user's other buffers that no process
    holds (left by a killed run); another live run's buffers are never touched: removing one
    while its ranks start would hang them. Returns the removed paths."""
    if not shm_dir.is_dir():
        return []
    uid = os.getuid()
    buffers = sorted(shm_dir.glob(f"{ALLREDUCE_BUFFER_PREFIX}_{uid}_*"))
    this_run = allreduce_buffer_prefix(master_addr, master_port) if master_port is not None else None
    doomed = [f for f in buffers if this_run is not None and f.name.startswith(this_run)]
    if orphans:
        doomed += [f for f in buffers if f not in doomed and not held_by_any_process(f)]
    removed = []
    for f in doomed:
        try:
            if f.stat().st_uid == uid:
                f.unlink()
                removed.append(str(f))
        except OSError:
            pass
    return removed


def held_by_any_process(path: Path) -> bool:
    """Whether any process has `path` open (a descriptor or a mapping), asked of the kernel: it
    grants a write lease only on a file that no other open file refers to (fcntl(2) F_SETLEASE),
    whatever the process or PID namespace. /proc/*/maps cannot always tell (some processes' maps
    are unreadable even to root in a container). DeepSpeed keeps its buffers open read-write and
    mapped for the life of a rank. True when the kernel cannot say (leases off, not ours, gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # non-blocking: never wait on someone's lease
    except OSError:
        return True
    try:
        # Should a process open the file in the instant the lease is held, the kernel signals the
        # holder: SIGIO by default, which would end this process; SIGURG is ignored by default.
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # EAGAIN: another open file exists
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
