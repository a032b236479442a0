"""CIFAR-10 with ResNet-18: mixed precision, a cosine learning-rate schedule stepped every
batch, and (for models bigger than your smallest device's memory) gradient checkpointing.

    invoke train --hosts pc,mac --script examples/cifar10_resnet.py --precision fp16 -- --download
    invoke train --script examples/cifar10_resnet.py -- --fake-data 256 --epochs 1   # try it, no files

--precision is the job's: fp16 runs float16 with loss scaling on CUDA and MPS (every rank
agrees on the scale and skips an overflowed step together) and bfloat16 on a CPU.
--checkpointing recomputes each ResNet stage's activations during backward instead of keeping
them (torch.utils.checkpoint): about a third more compute for a fraction of the activation
memory, which lets the Mac hold a larger share of the batch.
"""

import argparse

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchvision import datasets, transforms

import hvdhetero as hh

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 with the CIFAR stem (3x3 stride-1 conv, no max-pool)."""

    def __init__(self, checkpointing: bool = False):
        super().__init__()
        net = torchvision.models.resnet18(num_classes=10)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu)
        self.stages = nn.ModuleList([net.layer1, net.layer2, net.layer3, net.layer4])
        self.head = nn.Sequential(net.avgpool, nn.Flatten(), net.fc)
        self.checkpointing = checkpointing

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            if self.checkpointing and self.training:
                x = checkpoint(stage, x, use_reentrant=False)  # activations recomputed in backward
            else:
                x = stage(x)
        return self.head(x)


def data(args):
    augment = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    plain = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    if args.fake_data:
        return (datasets.FakeData(args.fake_data, (3, 32, 32), 10, augment),
                datasets.FakeData(max(args.fake_data // 4, 1), (3, 32, 32), 10, plain, random_offset=10**6))
    return (datasets.CIFAR10(args.data_dir, train=True, download=args.download, transform=augment),
            datasets.CIFAR10(args.data_dir, train=False, download=args.download, transform=plain))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=512, help="global: all ranks together")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--fake-data", type=int, default=0, metavar="N")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader worker processes per rank")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing per ResNet stage")
    args = parser.parse_args()

    job = hh.init()
    train_set, test_set = data(args)
    model = ResNet18(args.checkpointing).to(job.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    steps = args.epochs * (len(train_set) // args.batch_size + 1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps,
                                                   anneal_strategy="cos", pct_start=0.15)
    # The schedule steps every batch: passed to prepare, it steps once per global step even
    # when a rank runs its share in micro-batches.
    model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=args.batch_size,
                                           num_workers=args.workers, scheduler=schedule)
    for epoch in job.epochs(args.epochs):
        model.train()
        for x, y in loader:
            with job.autocast():
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            job.backward(loss)
            job.clip_grad_norm_(5.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()

        def score(batch):
            x, y = batch
            out = model(x).float()
            return {"loss": F.cross_entropy(out, y, reduction="sum"), "correct": (out.argmax(1) == y).sum(),
                    "count": len(y)}

        test = job.evaluate(score, test_set)
        job.log(test_loss=test["loss"] / test["count"], test_accuracy=test["correct"] / test["count"],
                lr=schedule.get_last_lr()[0])
        if job.is_main:
            print(f"epoch {epoch}: test accuracy {test['correct'] / test['count']:.2%}", flush=True)
    job.save(model.state_dict(), "resnet18_cifar10.pt")


if __name__ == "__main__":
    main()
