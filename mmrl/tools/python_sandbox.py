"""`python`: run model-written Python code in a throwaway, locked-down process.

Each call starts a fresh `python -I -B` (subprocess, its own session/process group) in the
trajectory's temp dir (its cwd; files persist across calls, `close()` removes it). Enforced:

  * kernel, when we are root (`isolation="auto"`/"kernel"): the child unshares a new network
    namespace (no interface up: no connection can leave), a mount namespace whose root is a
    tmpfs holding only the interpreter's prefixes and shared libraries read-only, /dev/null and
    the temp dir (chroot: /etc, /tmp, the project are simply absent), and a PID namespace whose
    pid 1 is a reaper; the code runs as pid 2 under an unprivileged uid (`uid`, default 65534),
    so RLIMIT_NPROC (not enforced for root) caps a fork bomb, and when the code's process ends
    or is killed, pid 1 exits and the kernel kills everything left in the namespace.
  * rlimits (always): RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE,
    no core files.
  * the parent: wall-clock `timeout_s`, output cap `max_output_bytes` (reads at most that much,
    then kills), and SIGKILL to the whole process group at the end of every call.
  * a Python audit hook (always; the only file/network guard without root, and bypassable with
    ctypes, which is why the kernel layer comes first): refuses non-AF_UNIX sockets, connect,
    bind, DNS, exec/spawn, and any path access outside the temp dir (reads also allowed under
    the interpreter's prefixes).
Every failure comes back as an error `ToolResult`; the calling process is never touched."""
from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

from mmrl.registry import register
from mmrl.tools.base import Tool, ToolError, ToolResult

# Runs in the child, as `python -I -B -c _CHILD <json config>`, code on stdin. Kept free of
# mmrl imports: the child may be another interpreter, and in the jail the project is not there.
_CHILD = r'''
import ctypes, json, os, resource, signal, sys, traceback
cfg = json.loads(sys.argv[1])
code = sys.stdin.buffer.read().decode("utf-8", "replace")
_fd = os.open(os.devnull, os.O_RDONLY); os.dup2(_fd, 0); os.close(_fd)
work = cfg["work"]
prefixes = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
prefixes |= {os.path.realpath(p) for p in prefixes}
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

def report(line):  # to the tool, on its own pipe: untangled from whatever the code prints
    try:
        os.write(cfg["status_fd"], (line[:1000].replace("\n", " ") + "\n").encode())
    except OSError:
        pass

def quiet():  # this process must not hold the output pipe: its EOF means the code's processes are gone
    fd = os.open(os.devnull, os.O_WRONLY); os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)

def ok(r, what):
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    ok(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")

def jail():
    """New net+mount+pid namespaces; a tmpfs root with the runtime bound read-only."""
    ok(libc.unshare(0x00020000 | 0x40000000 | 0x20000000), "unshare")  # NEWNS | NEWNET | NEWPID
    RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
    mount(None, "/", None, REC | PRIVATE)  # nothing we mount leaks to the host
    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
    binds = sorted(prefixes | {p for p in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
                               if os.path.isdir(p) and not os.path.islink(p)})
    done = []
    for src in binds:  # parents first; a path inside a bound one is already there
        if any(src == d or src.startswith(d + "/") for d in done):
            continue
        os.makedirs(root + src, exist_ok=True)
        mount(src, root + src, None, BIND | REC)
        mount(None, root + src, None, BIND | REMOUNT | RDONLY | NOSUID)
        done.append(src)
    for link in ("/lib", "/lib64", "/lib32"):  # merged-/usr systems: keep the symlinks
        if os.path.islink(link) and not os.path.lexists(root + link):
            os.symlink(os.readlink(link), root + link)
    for dev, ro in (("/dev/null", False), ("/dev/zero", True), ("/dev/urandom", True), ("/etc/ld.so.cache", True)):
        if os.path.exists(dev):
            os.makedirs(os.path.dirname(root + dev), exist_ok=True)
            open(root + dev, "a").close()
            mount(dev, root + dev, None, BIND)
            if ro:
                mount(None, root + dev, None, BIND | REMOUNT | RDONLY | NOSUID)
    os.makedirs(root + work, exist_ok=True)
    mount(work, root + work, None, BIND)

def enter_jail():
    """In the namespace's pid 1: chroot, drop root for good."""
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the waiter dying takes the whole namespace
    os.chroot(cfg["root"]); os.chdir(work)
    os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS

def under(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

def run(jailed):
    lim = cfg["limits"]
    for name, soft, hard in (("RLIMIT_CPU", lim["cpu"], lim["cpu"] + 1), ("RLIMIT_AS", lim["mem"], lim["mem"]),
                             ("RLIMIT_NPROC", lim["nproc"], lim["nproc"]), ("RLIMIT_FSIZE", lim["fsize"], lim["fsize"]),
                             ("RLIMIT_NOFILE", lim["nofile"], lim["nofile"]), ("RLIMIT_CORE", 0, 0)):
        cur = resource.getrlimit(getattr(resource, name))[1]  # an unprivileged run cannot raise a hard limit
        cap = (lambda v: v) if cur == resource.RLIM_INFINITY else (lambda v: min(v, cur))
        resource.setrlimit(getattr(resource, name), (cap(soft), cap(hard)))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big file is an OSError, not a kill
    read_ok = (os.path.realpath(work), "/dev/null", "/dev/zero", "/dev/urandom") + tuple(sorted(prefixes))
    write_ok = (os.path.realpath(work), "/dev/null")
    no_fork = os.geteuid() == 0 and not jailed  # RLIMIT_NPROC means nothing to root
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.gethostbyaddr", "os.exec", "os.posix_spawn", "os.spawn",
               "os.system", "subprocess.Popen", "os.startfile", "pty.spawn"}
    blocked |= {"os.fork", "os.forkpty"} if no_fork else set()
    paths = {"open": 1, "os.listdir": 0, "os.scandir": 0, "os.chdir": 0, "os.mkdir": 2, "os.remove": 2,
             "os.rmdir": 2, "os.rename": 3, "os.replace": 3, "os.symlink": 3, "os.link": 3, "os.truncate": 2,
             "os.chmod": 2, "os.chown": 2, "os.utime": 2, "os.setxattr": 2, "os.removexattr": 2,
             "os.listxattr": 0, "os.getxattr": 0, "os.mkfifo": 2, "os.mknod": 2, "shutil.chown": 2}

    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "socket.__new__" and args[1] != 1:  # AF_UNIX only (socketpair for asyncio)
            raise PermissionError("sandbox: network sockets are not allowed")
        kind = paths.get(event)
        if kind is None:
            return
        targets = args[:2] if kind == 3 else args[:1]
        write = kind >= 2
        if event == "open":
            mode, flags = args[1], args[2] or 0
            write = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & W)
        for p in targets:
            if p is None or isinstance(p, int):
                continue  # an fd we already hold, or the cwd
            p = os.path.realpath(os.fsdecode(p))
            if not under(p, write_ok if write else read_ok):
                raise PermissionError(f"sandbox: access to {p!r} is not allowed (only the working directory)")

    sys.stdout.reconfigure(line_buffering=True)  # keep prints and tracebacks in order in the merged pipe
    sys.addaudithook(hook)
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    status, main = 0, os.getpid()
    try:
        exec(compile(code, "<code>", "exec"), g)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this bootstrap's frame
        if os.getpid() == main:  # not from a process the code forked
            report("exc " + traceback.format_exception_only(type(e), e)[-1].strip())
        status = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            pass
    os._exit(status & 0xFF)

jailed = False
if cfg["isolation"] != "hook" and os.geteuid() == 0:
    try:
        jail(); jailed = True
    except OSError as e:
        if cfg["isolation"] == "kernel":
            print(f"sandbox: kernel isolation unavailable: {e}", file=sys.stderr); os._exit(125)
elif cfg["isolation"] == "kernel":
    print("sandbox: kernel isolation needs root", file=sys.stderr); os._exit(125)
if not jailed:
    run(False)
pid = 0
# SIGTERM from the tool: kill pid 1 (the kernel then kills the rest of the namespace) and reap it
# here, so nothing is left as a zombie for the host's init to collect
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL) if pid > 0 else os._exit(143))
pid = os.fork()
if pid == 0:  # pid 1 of the new namespace: a reaper only. The code runs as pid 2, because the
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # kernel drops default-action signals (SIGXCPU...) to a pid 1
    try:
        enter_jail()
        worker = os.fork()
    except BaseException as e:
        print(f"sandbox: could not enter the jail: {e}", file=sys.stderr); os._exit(125)
    if worker == 0:
        run(True)
    quiet()
    while True:  # reap orphans too; when the code's process is done, exiting kills the rest
        p, st = os.waitpid(-1, 0)
        if p == worker:
            break
    if os.WIFSIGNALED(st):
        report(f"signal {os.WTERMSIG(st)}"); os._exit(128 + os.WTERMSIG(st))
    os._exit(os.WEXITSTATUS(st))
quiet()  # this waiter stays root, outside the chroot, and only relays pid 1's status
os.close(cfg["status_fd"])
_, st = os.waitpid(pid, 0)
if os.WIFSIGNALED(st):
    try:
        if os.WTERMSIG(st) != signal.SIGKILL:
            signal.signal(os.WTERMSIG(st), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(st))
    except BaseException:
        pass
os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)
'''


@register("tool", "python")
class PythonSandbox(Tool):
    """Runs `code` in a fresh, isolated Python process; returns its stdout+stderr."""

    name = "python"
    description = ("Run Python code in a sandbox and return what it prints (stdout and stderr). Each call is a fresh "
                   "process: print what you need. Files written to the working directory persist between calls. "
                   "No network, no access outside the working directory, limited time, memory and output.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "Python source to run"}},
                  "required": ["code"]}

    def __init__(self, sample: Any = None, timeout_s: float = 5.0, cpu_s: int | None = None,
                 memory_mb: int = 512, max_processes: int = 32, max_file_mb: int = 16, max_open_files: int = 64,
                 max_output_bytes: int = 64 * 1024, isolation: str = "auto", uid: int = 65534,
                 python: str | None = None, tmp_dir: str | None = None):
        super().__init__(sample)
        if isolation not in ("auto", "kernel", "hook"):
            raise ValueError(f"python: isolation must be 'auto', 'kernel' or 'hook', got {isolation!r}")
        self.timeout_s, self.max_output_bytes = float(timeout_s), int(max_output_bytes)
        self.limits = {"cpu": int(cpu_s or math.ceil(self.timeout_s)), "mem": int(memory_mb) << 20,
                       "nproc": int(max_processes), "fsize": int(max_file_mb) << 20, "nofile": int(max_open_files)}
        self.isolation, self.uid, self.python = isolation, int(uid), python or sys.executable
        self.base = tempfile.mkdtemp(prefix="mmrl-python-", dir=tmp_dir)
        self.dir, self.root = os.path.join(self.base, "work"), os.path.join(self.base, "root")
        os.mkdir(self.dir, 0o700)
        os.mkdir(self.root, 0o755)
        if os.geteuid() == 0 and isolation != "hook":
            os.chown(self.dir, self.uid, self.uid)  # the code runs as `uid`: its dir is the one place it may write
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.base, True)  # even if close() is forgotten
        self.calls = self.errors = 0
        self.last_pgid: int | None = None

    def call(self, function: str, arguments: dict[str, Any]) -> ToolResult:
        if function != self.name:
            raise ToolError(f"unknown function {function!r}; this tool has only {self.name!r}")
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError(f"'code' must be a string of Python source, got {type(code).__name__}")
        if not self._cleanup.alive:
            raise ToolError("the sandbox is closed")
        result = self.run(code)
        self.calls += 1
        self.errors += result.error
        return result

    def run(self, code: str) -> ToolResult:
        """One execution; never raises for anything the code does."""
        status_r, status_w = os.pipe()
        cfg = {"status_fd": status_w, "work": self.dir, "root": self.root, "uid": self.uid,
               "isolation": self.isolation, "limits": self.limits}
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.dir, "TMPDIR": self.dir,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # BLAS pools vs RLIMIT_AS
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen([self.python, "-I", "-B", "-c", _CHILD, json.dumps(cfg)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.dir, env=env,
                                    start_new_session=True, pass_fds=(status_w,))  # own group: killed as a whole
        except OSError as e:
            os.close(status_r)
            return ToolResult(text=f"error: could not start the sandbox: {e}", error=True)
        finally:
            os.close(status_w)
        self.last_pgid = proc.pid
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))  # the child reads all of it before anything else
            proc.stdin.close()
        except OSError:
            pass
        try:
            out, why = self._collect(proc, t0 + self.timeout_s)
        finally:
            self._kill(proc)
            os.set_blocking(status_r, False)
            try:
                status = dict(ln.split(" ", 1) for ln in os.read(status_r, 65536).decode("utf-8", "replace")
                              .splitlines() if " " in ln)
            except OSError:  # nothing written, and a writer left (a process that escaped the group)
                status = {}
            os.close(status_r)
        rc = proc.returncode
        if status.get("signal", "").isdigit():  # the jailed code's process (pid 2) was killed
            rc = -int(status["signal"])
        text = out.decode("utf-8", "replace")
        if why == "timeout":
            error = f"killed after {self.timeout_s:g} s (timeout)"
        elif why == "output":
            error = f"output truncated at {self.max_output_bytes} bytes; the process was killed"
        elif rc is not None and rc < 0:
            sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
            hint = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (a resource limit)"}.get(sig, "")
            error = f"killed by {sig}{hint}"
        elif rc == 125 and text.startswith("sandbox:"):
            error = text.strip().splitlines()[-1]
        elif rc:
            error = status.get("exc") or f"exit status {rc}"
        else:
            return ToolResult(text=text)
        return ToolResult(text=(text.rstrip("\n") + "\n" if text.strip() else "") + f"error: {error}", error=True)

    def _collect(self, proc: subprocess.Popen, deadline: float) -> tuple[bytes, str | None]:
        """Read merged output until EOF and exit, the deadline, or the cap; never more than the cap."""
        fd, buf = proc.stdout.fileno(), bytearray()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(buf), "timeout"
            if not poller.poll(left * 1000):
                continue
            chunk = os.read(fd, min(65536, self.max_output_bytes + 1 - len(buf)))
            if not chunk:
                break
            buf += chunk
            if len(buf) > self.max_output_bytes:
                return bytes(buf[: self.max_output_bytes]), "output"
        while time.monotonic() < deadline:  # EOF: wait for the exit without reaping (keeps the pgid ours)
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return bytes(buf), None
            time.sleep(0.005)
        return bytes(buf), "timeout"

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """Stop the child and everything it started; return once they are gone (<= ~3 s)."""
        def exited(within: float) -> bool:  # without reaping: while unreaped, its pid (= our pgid) stays ours
            end = time.monotonic() + within
            while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if time.monotonic() > end:
                    return False
                time.sleep(0.005)
            return True

        if not exited(0):
            os.kill(proc.pid, signal.SIGTERM)  # jailed: the root waiter kills and reaps the namespace (see _CHILD)
            exited(1.0)
        fd, poller, end = proc.stdout.fileno(), select.poll(), time.monotonic() + 2.0
        poller.register(fd, select.POLLIN | select.POLLHUP)
        while time.monotonic() < end:  # sweep the group until nothing holds the pipe open any more
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break
            if poller.poll(10) and not os.read(fd, 65536):
                break  # EOF: every writer is dead
        proc.wait()  # reaped only now: until here no other process could have been given our pgid
        proc.stdout.close()

    def state(self) -> dict[str, Any]:
        return {"python_calls": self.calls, "python_errors": self.errors}

    def close(self) -> None:
        self._cleanup()
