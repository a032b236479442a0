"""After training, rank 0 works on alone (an export, a long evaluation) while the other ranks'
scripts have returned: they are done, not frozen. Its own argument: seconds rank 0 lingers."""

import sys
import time

import hvdhetero as hh

job = hh.init()
job.barrier()
if job.is_main:
    time.sleep(float(sys.argv[1]))
    print("rank 0 finished its own work", flush=True)
