"""Two ranks: rank 1 comes to an allreduce 2 s after rank 0. Rank 0 waits once with Horovod's
own hvd.synchronize and once with hvdhetero's collectives.wait, timing the wait's wall and CPU
seconds (this process's, all threads) each time. Then rank 1 joins a patient barrier (job.barrier's:
"rank 0 downloads, the others wait") 1.5 times HVDHETERO_COLLECTIVE_TIMEOUT_S (set by the test) late,
and rank 0 waits for it; then rank 1 never joins: rank 0's barrier and allgather_object each give
up after the bound with StalledCollective. Prints IDLE_WAIT {json} on rank 0."""

import json
import os
import time

import horovod.torch as hvd
import torch

from hvdhetero.rank import collectives
from hvdhetero.rank.collectives import wait

LATE_S = 2.0

hvd.init()
out = {}
for how, waiter in (("horovod", hvd.synchronize), ("hvdhetero", lambda handle: wait(handle, "idle"))):
    hvd.barrier()
    if hvd.rank() == 1:
        time.sleep(LATE_S)
    t = torch.full((4,), float(hvd.rank() + 1))
    handle = hvd.allreduce_async_(t, op=hvd.Sum, name=f"idle.{how}")
    wall, cpu = time.perf_counter(), time.process_time()
    result = waiter(handle)
    out[how] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "sum": result.tolist()}
hvd.barrier()
limit = collectives.collective_timeout_s()
if hvd.rank() == 1:
    time.sleep(1.5 * limit)
started = time.monotonic()
collectives.barrier("idle.patient", "job.barrier()", collectives.patient_timeout_s())
out["patient_s"] = time.monotonic() - started
if hvd.rank() == 1:  # busy on its own past the bound of both of rank 0's collectives, then gone
    time.sleep(2 * limit + 2)
    os._exit(0)
out["stalled"] = {}
for name, call in (("barrier", lambda: collectives.barrier()),
                   ("allgather_object", lambda: collectives.allgather_object("x", "idle.gather", "job.evaluate()"))):
    started = time.monotonic()
    try:
        call()
        out["stalled"][name] = {"error": None}
    except collectives.StalledCollective as err:
        out["stalled"][name] = {"error": str(err), "after_s": time.monotonic() - started}
print("IDLE_WAIT " + json.dumps(out), flush=True)
os._exit(0)  # its collectives stay pending: no Horovod shutdown to wait on them
