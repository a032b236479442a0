"""A tiny Horovod job for tests: every rank allreduces its rank number and prints the sum."""

import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks")
print(f"rank {hvd.rank()}/{hvd.size()} sum {total.item():g}", flush=True)
hvd.shutdown()
