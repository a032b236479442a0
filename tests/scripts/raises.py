"""A script that fails on one rank while the other waits for it in a collective."""

import hvdhetero as hh


def load_config(rank):
    if rank == 1:
        raise ValueError("boom on purpose")


job = hh.init()
print(f"rank {job.rank}: loading its config", flush=True)
load_config(job.rank)
job.barrier()  # rank 0 waits here for a rank that will never come
