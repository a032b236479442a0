"""vae_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed. Its loss
is summed over the batch; job.backward takes the batch's mean (each rank's weighed by its
share of the global batch), so the port divides by the batch's size: with Adam the steps are
the same, and the reduced gradient is exactly the whole global batch's.

    invoke train --script tests/scripts/ported/vae.py -- --epochs 10
"""

import argparse

import torch
import torch.utils.data
from sklearn.datasets import load_digits
from torch import nn, optim
from torch.nn import functional as F

import hvdhetero as hh  # hh:


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc21 = nn.Linear(128, 8)
        self.fc22 = nn.Linear(128, 8)
        self.fc3 = nn.Linear(8, 128)
        self.fc4 = nn.Linear(128, 64)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 64))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    """Reconstruction + KL divergence, summed over all elements and the batch."""
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 64), reduction="sum")
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def train(args, job, model, device, train_loader, optimizer, epoch):  # hh: job
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        data = data.to(device)
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        job.backward(loss / len(data))  # hh: the batch's mean
        train_loss += loss.item()
        optimizer.step()
    print(f"====> Epoch: {epoch} Average loss: {train_loss / len(train_loader.dataset):.4f}")


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for data, _ in test_loader:
            data = data.to(device)
            recon_batch, mu, logvar = model(data)
            test_loss += loss_function(recon_batch, data, mu, logvar).item()
    print(f"====> Test set loss: {test_loss / len(test_loader.dataset):.4f}")


def main():
    parser = argparse.ArgumentParser(description="VAE digits example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    job = hh.init()  # hh:
    device = job.device  # hh:

    images, labels = load_digits(return_X_y=True)
    pixels, labels = torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels)
    train_set = torch.utils.data.TensorDataset(pixels[:1500], labels[:1500])
    test_set = torch.utils.data.TensorDataset(pixels[1500:], labels[1500:])
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.batch_size)

    model = VAE().to(device)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, train_loader = job.prepare(model, optimizer, train_set, global_batch=args.batch_size)  # hh:
    for epoch in job.epochs(args.epochs):  # hh:
        train(args, job, model, device, train_loader, optimizer, epoch + 1)  # hh: job
        test(model, device, test_loader)


if __name__ == "__main__":
    main()
