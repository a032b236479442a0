"""MNIST with a small CNN: a single-device PyTorch script plus the ten lines that make it
train across your machines (marked `# hh:`).

    invoke train --script examples/mnist.py -- --download            # 2 CPU ranks here
    invoke train --hosts pc,mac --script examples/mnist.py -- --epochs 5
    python examples/mnist.py --download                              # one process, no launcher

Every rank reads the data itself: with `--download` each host fetches MNIST into --data-dir
(or copy it there once with `invoke push-data --src data`). `--fake-data N` trains on N random images
instead (no files needed; for trying the launch, not for accuracy).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torchvision import datasets, transforms

import hvdhetero as hh  # hh:


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def data(args):
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    if args.fake_data:
        fake = lambda n, seed: datasets.FakeData(n, (1, 28, 28), 10, normalize, random_offset=seed)  # noqa: E731
        return fake(args.fake_data, 0), fake(max(args.fake_data // 4, 1), 10**6)
    return (datasets.MNIST(args.data_dir, train=True, download=args.download, transform=normalize),
            datasets.MNIST(args.data_dir, train=False, download=args.download, transform=normalize))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="global: all ranks together")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--fake-data", type=int, default=0, metavar="N")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    args = parser.parse_args()

    job = hh.init()  # hh: join the other ranks; job.device is this rank's mps, cuda or cpu
    train_set, test_set = data(args)
    model = Net().to(job.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = job.prepare(model, optimizer, train_set,  # hh: balanced shares
                                           global_batch=args.batch_size, num_workers=args.workers)
    for epoch in job.epochs(args.epochs):  # hh:
        model.train()
        for x, y in loader:  # this rank's share of each global batch, already on job.device
            with job.autocast():  # hh: mixed precision if `invoke train --precision` asks
                loss = F.cross_entropy(model(x), y)
            job.backward(loss)  # hh: instead of loss.backward(): gradients meet across ranks
            optimizer.step()
            optimizer.zero_grad()

        def score(batch):
            x, y = batch
            out = model(x)
            return {"loss": F.cross_entropy(out, y, reduction="sum"), "correct": (out.argmax(1) == y).sum(),
                    "count": len(y)}

        test = job.evaluate(score, test_set)  # hh: each rank scores a part, sums come back
        job.log(test_loss=test["loss"] / test["count"], test_accuracy=test["correct"] / test["count"])  # hh:
        if job.is_main:
            print(f"epoch {epoch}: test accuracy {test['correct'] / test['count']:.2%}", flush=True)
    job.save(model.state_dict(), "mnist_cnn.pt")  # hh: rank 0 writes runs/<run>/mnist_cnn.pt


if __name__ == "__main__":
    main()
