"""A step that is nearly all exchange, an ordinary hvdhetero script: digits' small classifier
beside a parameter of WIDE floats that only adds to the gradient every step reduces (128 MB at
the default), so that a rank killed at any moment is most likely killed in the middle of a
transfer. Its own arguments: epochs [WIDE]."""

import sys

import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.recipes import data

epochs = int(sys.argv[1])
wide = int(sys.argv[2]) if len(sys.argv) > 2 else 32 * 2**20
job = hh.init()
train_set, test_set, info = data.load("digits", "data", seed=job.config.seed)


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(info.in_channels * info.image_size ** 2, info.num_classes)
        self.ballast = torch.nn.Parameter(torch.zeros(wide))

    def forward(self, x):
        return self.head(x.flatten(1)) + 0.0 * self.ballast[:1].sum()


model = Wide().to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=64,
                                       loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
for epoch in job.epochs(epochs):
    for x, y in loader:
        job.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    test = job.evaluate(lambda b: {"correct": (model(b[0]).argmax(1) == b[1]).sum(), "count": len(b[1])}, test_set)
    job.log(test_accuracy=test["correct"] / test["count"])
