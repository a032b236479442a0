"""classifier_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed.

    invoke train --script tests/scripts/ported/classifier.py -- --epochs 6
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

import hvdhetero as hh  # hh:


class Digits(Dataset):
    """The first 1,500 digits train, the other 297 test; images as 8x8 uint8, like MNIST's."""

    def __init__(self, train, transform=None):
        images, labels = load_digits(return_X_y=True)
        part = slice(0, 1500) if train else slice(1500, None)
        self.images = (images[part] * 16).clip(0, 255).astype("uint8").reshape(-1, 8, 8)
        self.labels = labels[part]
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.transform(self.images[i]) if self.transform else self.images[i]
        return image, int(self.labels[i])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, job, model, device, train_loader, optimizer, epoch):  # hh: job
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        job.backward(loss)  # hh: gradients meet across ranks
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} "
          f"({100.0 * correct / len(test_loader.dataset):.0f}%)\n")


def main():
    parser = argparse.ArgumentParser(description="PyTorch digits example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    job = hh.init()  # hh:
    device = job.device  # hh: mps, cuda or cpu, per rank

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = Digits(train=True, transform=transform)
    test_set = Digits(train=False, transform=transform)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)

    model = Net().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    model, optimizer, train_loader = job.prepare(model, optimizer, train_loader)  # hh:
    for epoch in job.epochs(args.epochs):  # hh:
        train(args, job, model, device, train_loader, optimizer, epoch + 1)  # hh: job
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model:
        job.save(model.state_dict(), "digits_cnn.pt")  # hh: rank 0, into the run directory


if __name__ == "__main__":
    main()
