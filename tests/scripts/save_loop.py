"""Re-saves a run's newest checkpoint as steps N+1, N+2, ... through the job's own save path
(checkpoint.save_object, then keep_newest), each padded with a tracked 8 MB tensor so that a
save takes a while; prints "saved N" after each. tests/test_checkpoint.py SIGKILLs the saver at
random moments, as it would rank 0 mid-save.

Each line goes out in one write: under PYTHONUNBUFFERED (CI's machines) print() writes a line
and its newline apart, and a kill between the two ran "saved 98" into the server's "ended",
which the test never saw (it waited out pytest's 900 s).

A fork server, so that torch is imported once, not once per kill (20 imports were ~50 s of CI):
each "go" line on stdin forks a saver that starts as a restarted rank 0 would, from the newest
checkpoint on disk, and prints "ready PID"; once that saver is gone (killed) this prints "ended"."""

import os
import sys

import torch

from hvdhetero.rank import checkpoint


def say(line: str) -> None:
    """One whole line in one write(2): a kill lands before it or after it, never inside."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


run_dir = sys.argv[1]
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:  # the saver
        _, state = checkpoint.newest(run_dir)
        state["tracked"] = {"padding": {"weights": torch.randn(2_000_000)}}
        step = state["step"]
        say(f"ready {os.getpid()}")
        while True:
            step += 1
            state["step"] = step
            checkpoint.save_object(state, checkpoint.path_for(run_dir, step))
            checkpoint.keep_newest(run_dir, 3)
            say(f"saved {step}")
    os.waitpid(pid, 0)
    say("ended")
