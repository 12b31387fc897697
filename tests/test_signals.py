"""SIGTERM stops a Ray driver with the same exit status wherever it lands: also while the main
thread waits inside ray.get, where Ray's signal check turned the CLI's former SystemExit(143)
into SystemExit(1) (seen as `mmrl train` exiting 1 on SIGTERM under load)."""
from __future__ import annotations

import signal
import subprocess
import sys

# The task sends the driver SIGTERM from its worker process, so the signal arrives while the
# driver is blocked in ray.get (the task runs only after ray.get is called here; were the driver
# slower than that, the signal would land in Python code instead, which exits 143 too).
_DRIVER = """
import os, signal, sys, ray
from mmrl.utils.env import init_local_ray
from mmrl.utils.signals import sigterm_unwinds

init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=1)
def stop_the_driver(pid):
    os.kill(pid, signal.SIGTERM)
    import time
    time.sleep(600)

cleaned = False
with sigterm_unwinds() as terminated:
    try:
        try:
            ray.get(stop_the_driver.remote(os.getpid()))
        finally:
            cleaned = True  # a run's Runtime.close()
    except KeyboardInterrupt:
        print("terminated" if terminated else "ctrl-c", "cleaned" if cleaned else "not cleaned", flush=True)
        ray.shutdown()
        sys.exit(143 if terminated else 130)
sys.exit(3)  # ray.get returned: the signal was lost
"""


def test_sigterm_inside_ray_get_unwinds_and_exits_143() -> None:
    """With the former handler (`sys.exit(143)`) this driver exits 1."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 143, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "terminated cleaned" in proc.stdout


def test_the_handler_before_the_block_is_restored() -> None:
    from mmrl.utils.signals import sigterm_unwinds

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_unwinds() as terminated:
        assert signal.getsignal(signal.SIGTERM) is not before
        assert terminated == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigusr1_prints_every_threads_stack() -> None:
    """The CLI's hang diagnosis: `kill -USR1 PID` on a process stuck in a worker thread."""
    script = ("import os, signal, threading, time\n"
              "from mmrl.cli import _stacks_on_sigusr1\n"
              "_stacks_on_sigusr1()\n"
              "entered = threading.Event()\n"
              "def stuck_in_a_start(): entered.set(); time.sleep(600)\n"
              "threading.Thread(target=stuck_in_a_start, daemon=True).start()\n"
              "entered.wait()\n"  # the thread is inside the function from here on
              "os.kill(os.getpid(), signal.SIGUSR1)\n"
              "print('alive', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc
    assert "stuck_in_a_start" in proc.stderr and "Current thread" in proc.stderr, proc.stderr
