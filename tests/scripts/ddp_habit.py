"""The start of a DDP script (torchrun's), kept in a port: it starts torch.distributed itself,
which under invoke train has no torchrun variables to start from.

    invoke train --script tests/scripts/ddp_habit.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdhetero as hh

job = hh.init()
dist.init_process_group(backend="gloo")
model = DDP(torch.nn.Linear(4, 2).to(job.device))
