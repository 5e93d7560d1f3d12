"""Jobs for the process-pool tests: importable by spawned workers without torch."""
import signal
import time
from pathlib import Path


def ignore_ctrl_c():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def sleep_then_touch(job):
    seconds, path = job
    time.sleep(seconds)
    Path(path).touch()
    return path
