"""Re-saves a run's newest checkpoint as steps N+1, N+2, ... through the job's own save path
(checkpoint.save_object, then keep_newest), each padded with a tracked 8 MB tensor so that a
save takes a while; prints "saved N" after each. tests/test_checkpoint.py SIGKILLs the saver at
random moments, as it would rank 0 mid-save.

A fork server, so that torch is imported once, not once per kill (20 imports were ~50 s of CI):
each "go" line on stdin forks a saver that starts as a restarted rank 0 would, from the newest
checkpoint on disk, and prints "ready PID"; once that saver is gone (killed) this prints "ended"."""

import os
import sys

import torch

from hvdhetero.rank import checkpoint

run_dir = sys.argv[1]
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:  # the saver
        _, state = checkpoint.newest(run_dir)
        state["tracked"] = {"padding": {"weights": torch.randn(2_000_000)}}
        step = state["step"]
        print(f"ready {os.getpid()}", flush=True)
        while True:
            step += 1
            state["step"] = step
            checkpoint.save_object(state, checkpoint.path_for(run_dir, step))
            checkpoint.keep_newest(run_dir, 3)
            print(f"saved {step}", flush=True)
    os.waitpid(pid, 0)
    print("ended", flush=True)
