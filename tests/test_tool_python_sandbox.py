"""The `python` tool: real sandboxed processes (no mocks). Each test checks one specific outcome:
output comes back, network / files outside / memory / time / output / processes are contained,
files persist within a trajectory and vanish on close()."""
from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest

from mmrl.registry import resolve
from mmrl.tools import ToolResult, run_tool
from mmrl.tools.python_sandbox import PythonSandbox

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the kernel layer (namespaces, chroot, setuid) needs root")


@pytest.fixture
def sandbox():
    tool = PythonSandbox(None, timeout_s=60)
    yield tool
    tool.close()


def run(tool: PythonSandbox, code: str) -> ToolResult:
    # Wall-clock limits in these tests are hang guards sized for a loaded machine (60 s): each
    # test's outcome comes from the limit it tests (rlimits, namespaces, output cap), never from
    # how fast the machine is. Only the timeout test uses a short timeout on purpose.
    return tool.call("python", {"code": code})


def leftovers(pgid: int, since: float) -> list[psutil.Process]:
    """Processes still in the sandbox's process group, or (as root) of its uid, started in this test."""
    found = []
    for p in psutil.process_iter(["pid", "uids", "create_time", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.info["create_time"] < since - 1:
                continue
            if os.getpgid(p.pid) == pgid or (ROOT and p.info["uids"].real == 65534):
                found.append(p)
        except (psutil.Error, ProcessLookupError):
            pass
    return found


def test_registered_one_function():
    assert resolve("tool", "python") is PythonSandbox
    tool = PythonSandbox()
    try:
        [fn] = tool.functions()
        assert fn["function"]["name"] == "python"
        assert fn["function"]["parameters"]["properties"] == {"code": {"type": "string", "description": "Python source to run"}}
        assert fn["function"]["parameters"]["required"] == ["code"]
    finally:
        tool.close()


def test_prints_result_in_a_separate_process(sandbox):
    r = run(sandbox, "import os\nprint(sum(range(10)))\nprint(os.getpid())")
    assert not r.error
    total, pid = r.text.split()
    assert total == "45" and int(pid) != os.getpid()


def test_exception_is_reported_with_its_last_line(sandbox):
    r = run(sandbox, "print('before')\nraise ValueError('bad value')")
    assert r.error and r.text.startswith("before\n")
    assert r.text.splitlines()[-1] == "error: ValueError: bad value"


def test_network_is_blocked(sandbox):
    r = run(sandbox, "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)")
    assert r.error and "PermissionError" in r.text and "network sockets are not allowed" in r.text
    r = run(sandbox, "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert r.error and "PermissionError" in r.text


@needs_root
def test_network_blocked_by_the_kernel_even_without_the_hook():
    # ctypes calls libc directly: no audit event, so only the empty network namespace stops it
    code = ("import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "fd = libc.socket(2, 1, 0)\n"
            "addr = struct.pack('<HH4s8x', 2, socket.htons(22), bytes([127, 0, 0, 1]))\n"
            "print(fd >= 0, libc.connect(fd, addr, len(addr)), ctypes.get_errno())")
    tool = PythonSandbox(timeout_s=60, isolation="kernel")
    try:
        r = run(tool, code)
    finally:
        tool.close()
    made, rc, errno = r.text.split()
    assert not r.error and made == "True" and rc == "-1"
    assert int(errno) in (101, 111)  # ENETUNREACH (loopback is down in the new namespace) or ECONNREFUSED


def test_reading_outside_the_dir_fails(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    paths = [str(secret), "/etc/hostname", "/etc/passwd", os.path.abspath(__file__), str(tmp_path)]
    code = (f"import os\nfor p in {paths!r}:\n"
            "    try:\n        print(p, os.listdir(p) if os.path.isdir(p) else open(p).read())\n"
            "    except OSError as e:\n        print(p, type(e).__name__)\n"
            f"open({str(secret)!r}).read()")
    r = run(sandbox, code)
    assert r.error and "the secret" not in r.text and "root:" not in r.text and "['secret.txt']" not in r.text
    for line in r.text.splitlines()[:len(paths)]:
        assert line.rsplit(" ", 1)[1] in ("PermissionError", "FileNotFoundError"), line
    assert r.text.splitlines()[-1] in (f"error: PermissionError: sandbox: access to {str(secret)!r} is not allowed"
                                       " (only the working directory)",
                                       f"error: FileNotFoundError: [Errno 2] No such file or directory: {str(secret)!r}")


def test_writing_outside_the_dir_fails(sandbox, tmp_path):
    paths = [str(tmp_path / "out.txt"), f"/tmp/mmrl-sandbox-escape-{os.getpid()}.txt", "../escape.txt"]
    code = (f"import os\nfor p in {paths!r}:\n"
            "    try:\n        open(p, 'w').write('x'); print(p, 'WROTE')\n"
            "    except OSError as e:\n        print(p, type(e).__name__)\n"
            "os.symlink('/etc/passwd', 'link')")
    r = run(sandbox, code)
    lines = r.text.splitlines()
    for line in lines[:len(paths)]:
        assert line.rsplit(" ", 1)[1] in ("PermissionError", "FileNotFoundError"), line
    assert r.error and lines[-1].startswith("error: PermissionError: sandbox: access to '/etc/passwd'")
    assert not any(os.path.exists(p) for p in paths[:2])
    assert not os.path.exists(os.path.join(sandbox.base, "escape.txt"))


@needs_root
def test_files_blocked_by_the_kernel_even_without_the_hook(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    target = tmp_path / "escape.txt"
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None)\n"
            f"print(libc.open({str(secret).encode()!r}, 0), libc.open(b'/etc/passwd', 0),"
            f" libc.open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644))")
    tool = PythonSandbox(timeout_s=60, isolation="kernel")
    try:
        r = run(tool, code)
    finally:
        tool.close()
    assert not r.error and r.text.split() == ["-1", "-1", "-1"]
    assert not target.exists()


def test_fork_bomb_is_contained_and_cleaned_up():
    tool = PythonSandbox(timeout_s=60, max_processes=8)
    try:
        since = time.time()
        r = run(tool, "import os\nwhile True: os.fork()")
        assert r.error and tool.last_pgid is not None
        if ROOT:  # RLIMIT_NPROC under the unprivileged uid: fork fails, the namespace goes with pid 2
            assert r.text.splitlines()[-1] == "error: BlockingIOError: [Errno 11] Resource temporarily unavailable"
        assert leftovers(tool.last_pgid, since) == []
        assert run(tool, "print('still fine')").text == "still fine\n"  # the trajectory goes on
    finally:
        tool.close()


@needs_root  # without the pid namespace a child that leaves the process group (setsid) is not found
def test_background_child_does_not_survive_the_call(sandbox):
    since = time.time()
    r = run(sandbox, "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent')")
    assert r.text == "parent\n" and not r.error
    assert leftovers(sandbox.last_pgid, since) == []


def test_hook_layer_alone_blocks_network_files_and_processes(tmp_path):
    """What a run without root gets (and the second layer under the kernel one)."""
    tool = PythonSandbox(timeout_s=60, isolation="hook")
    attempts = ["import socket; socket.socket()", "open('/etc/hostname').read()",
                f"open({str(tmp_path / 'x.txt')!r}, 'w')", "import subprocess; subprocess.run(['true'])"]
    code = (f"for a in {attempts!r}:\n    try:\n        exec(a); print('ALLOWED')\n"
            "    except PermissionError as e:\n        print(str(e).split(':')[0])\n"
            "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())")
    try:
        r = run(tool, code)
    finally:
        tool.close()
    assert not r.error and r.text.split() == ["sandbox"] * 4 + ["ok"]
    assert not (tmp_path / "x.txt").exists()


def test_huge_allocation_is_refused(sandbox):
    r = run(sandbox, "b = bytearray(10 * 1024 ** 3)")
    assert r.error and r.text.splitlines()[-1] == "error: MemoryError"


def test_limits_are_set_in_the_child():
    tool = PythonSandbox(timeout_s=60, cpu_s=3, memory_mb=256, max_processes=16, max_file_mb=2, max_open_files=32)
    try:
        r = run(tool, "import os, resource as r\n"
                      "print([r.getrlimit(getattr(r, 'RLIMIT_' + n)) for n in ('CPU', 'AS', 'NPROC', 'FSIZE', 'NOFILE')])\n"
                      "print(os.getuid(), os.getpid())")
    finally:
        tool.close()
    limits, ids = r.text.splitlines()
    assert not r.error and limits == str([(3, 4), (256 << 20,) * 2, (16, 16), (2 << 20,) * 2, (32, 32)])
    if ROOT:  # the kernel layer: an unprivileged uid, as pid 2 of its own pid namespace (pid 1 reaps)
        assert ids == "65534 2"


def test_endless_loop_is_killed_by_the_timeout():
    tool = PythonSandbox(timeout_s=1)
    try:
        t0 = time.monotonic()
        r = tool.call("python", {"code": "print('start', flush=True)\nwhile True: pass"})
        took = time.monotonic() - t0
    finally:
        tool.close()
    assert r.error and r.text.endswith("error: killed after 1 s (timeout)")
    assert took >= 1  # killed by the wall-clock limit, not before


def test_huge_output_is_truncated_to_the_cap(sandbox):
    r = run(sandbox, "import sys\nsys.stdout.write('x' * (10 * 1024 * 1024))")
    assert r.error
    body, last = r.text.rsplit("\n", 1)
    assert body == "x" * (64 * 1024)
    assert last == "error: output truncated at 65536 bytes; the process was killed"


def test_big_file_is_cut_by_the_file_size_limit():
    tool = PythonSandbox(timeout_s=60, max_file_mb=1)
    try:
        r = run(tool, "open('big.bin', 'wb').write(b'x' * (4 << 20))")
        assert r.error and "File too large" in r.text
        assert os.path.getsize(os.path.join(tool.dir, "big.bin")) <= 1 << 20
    finally:
        tool.close()


def test_files_persist_between_calls_and_dir_is_removed_on_close():
    tool = PythonSandbox(timeout_s=60)
    work = tool.dir
    assert os.path.isdir(work)
    r1 = run(tool, "with open('notes.txt', 'w') as f:\n    f.write('kept')\nimport os\nprint(os.getcwd())")
    assert not r1.error and r1.text.strip() == work
    r2 = run(tool, "print(open('notes.txt').read())")
    assert not r2.error and r2.text == "kept\n"
    tool.close()
    assert not os.path.exists(work) and not os.path.exists(tool.base)
    tool.close()  # idempotent


def test_through_run_tool_returns_tool_results(sandbox):
    result, seconds = asyncio.run(run_tool(sandbox, "python", {"code": "print(6 * 7)"}, 30.0))
    assert isinstance(result, ToolResult) and result.text == "42\n" and not result.error and seconds > 0
    result, _ = asyncio.run(run_tool(sandbox, "python", {"code": "1/0"}, 30.0))
    assert isinstance(result, ToolResult) and result.error and result.text.endswith("ZeroDivisionError: division by zero")
    result, _ = asyncio.run(run_tool(sandbox, "python", {"source": "print(1)"}, 30.0))
    assert result.error and "'code' must be a string" in result.text
    assert sandbox.state() == {"python_calls": 2, "python_errors": 1}
