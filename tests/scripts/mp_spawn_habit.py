"""A DDP script's start kept in a port: torch.multiprocessing.spawn(main, nprocs=...), one process
per GPU, each calling hh.init(). invoke train starts the rank's process already: each spawned
one is told so, where it would have joined Horovod again under the rank's name.

    invoke train --script tests/scripts/mp_spawn_habit.py
"""

import torch.multiprocessing as mp

import hvdhetero as hh


def main(local_rank, world_size):
    job = hh.init()
    print(f"process {local_rank} of {world_size}: rank {job.rank}")


if __name__ == "__main__":
    mp.spawn(main, args=(2,), nprocs=2)
