"""Two ranks: rank 1 comes to an allreduce 2 s after rank 0. Rank 0 waits once with Horovod's
own hvd.synchronize and once with hvdhetero's reducer.wait, timing the wait's wall and CPU
seconds (this process's, all threads) each time. Prints IDLE_WAIT {json} on rank 0."""

import json
import time

import horovod.torch as hvd
import torch

from hvdhetero.rank.reducer import wait

LATE_S = 2.0

hvd.init()
out = {}
for how, waiter in (("horovod", hvd.synchronize), ("hvdhetero", wait)):
    hvd.barrier()
    if hvd.rank() == 1:
        time.sleep(LATE_S)
    t = torch.full((4,), float(hvd.rank() + 1))
    handle = hvd.allreduce_async_(t, op=hvd.Sum, name=f"idle.{how}")
    wall, cpu = time.perf_counter(), time.process_time()
    result = waiter(handle)
    out[how] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "sum": result.tolist()}
if hvd.rank() == 0:
    print("IDLE_WAIT " + json.dumps(out), flush=True)
hvd.shutdown()
