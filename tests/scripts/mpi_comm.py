"""A script that uses MPI itself beside the API: job.mpi_comm is mpi4py's COMM_WORLD under
backend mpi (None under Gloo)."""

import json

import hvdhetero as hh

job = hh.init()
comm = job.mpi_comm
if comm is None:
    print("MPI_COMM none", flush=True)
else:
    mine = {"rank": comm.Get_rank(), "size": comm.Get_size(), "sum": comm.allreduce(comm.Get_rank()),
            "horovod_rank": job.rank}
    print("MPI_COMM " + json.dumps(mine), flush=True)
