"""Every Horovod collective a user's script can call, on 2+ ranks, with known answers: prints
one line `COLLECTIVES {json}` per rank: each collective's name -> "ok" or the error it raised.
A collective that aborts the process prints nothing (the test then sees the rank's exit code)."""

import json

import horovod.torch as hvd
import torch

hvd.init()
rank, size = hvd.rank(), hvd.size()
results = {}


def check(name, fn):
    try:
        results[name] = "ok" if fn() else "wrong result"
    except Exception as err:  # noqa: BLE001 - a clear Python error is an allowed outcome; recorded
        results[name] = f"error: {type(err).__name__}: {err}"


def ranks_tensor(n, dtype=torch.float32):
    """rows r*n .. : every rank holds [0..size*n) + rank*1000, so sums are known."""
    return (torch.arange(size * n, dtype=torch.float64) + rank * 1000).to(dtype)


def summed(n, dtype=torch.float32):
    return (torch.arange(size * n, dtype=torch.float64) * size + 1000 * sum(range(size))).to(dtype)


for dtype in (torch.float32, torch.float64, torch.int32):
    tag = str(dtype).split(".")[1]
    check(f"allreduce {tag}", lambda: torch.equal(hvd.allreduce(ranks_tensor(6, dtype), op=hvd.Sum), summed(6, dtype)))
    mine = slice(rank * 3, rank * 3 + 3)
    check(f"reducescatter {tag}",
          lambda: torch.equal(hvd.reducescatter(ranks_tensor(3, dtype), op=hvd.Sum), summed(3, dtype)[mine]))
check("grouped_reducescatter", lambda: all(
    torch.equal(out, summed(n)[rank * n:rank * n + n])
    for n, out in zip((2, 5), hvd.grouped_reducescatter([ranks_tensor(2), ranks_tensor(5)], op=hvd.Sum))))
# 2*size+1 rows: Horovod gives the first ranks one row more than the last
uneven = [r * 2 + min(r, 1) for r in range(size + 1)]  # row offsets: rank 0 takes 3 rows, the others 2
check("reducescatter uneven", lambda: torch.equal(
    hvd.reducescatter(torch.arange(2 * size + 1, dtype=torch.float32) + rank * 1000, op=hvd.Sum),
    (torch.arange(2 * size + 1, dtype=torch.float32) * size + 1000 * sum(range(size)))[uneven[rank]:uneven[rank + 1]]))
check("reducescatter average", lambda: torch.allclose(
    hvd.reducescatter(ranks_tensor(4), op=hvd.Average), summed(4)[rank * 4:rank * 4 + 4] / size))
check("grouped_allreduce", lambda: all(
    torch.equal(out, summed(n)) for n, out in zip((1, 7), hvd.grouped_allreduce([ranks_tensor(1), ranks_tensor(7)],
                                                                                 op=hvd.Sum))))
check("allgather", lambda: torch.equal(hvd.allgather(torch.full((rank + 1, 2), float(rank))),
                                       torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])))
check("broadcast", lambda: torch.equal(hvd.broadcast(torch.full((3,), float(rank)), root_rank=size - 1),
                                       torch.full((3,), float(size - 1))))
check("alltoall", lambda: torch.equal(hvd.alltoall(torch.full((size,), float(rank))),
                                      torch.arange(size, dtype=torch.float32)))
check("broadcast_object", lambda: hvd.broadcast_object({"r": rank}, root_rank=0) == {"r": 0})
check("allgather_object", lambda: hvd.allgather_object(rank) == list(range(size)))
check("barrier", lambda: hvd.barrier() is None)
print("COLLECTIVES " + json.dumps(results, sort_keys=True), flush=True)
hvd.shutdown()
