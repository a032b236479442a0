"""gan_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed. Both models
and both optimizers go to one job.prepare, which gives back the same models and optimizers and a
loader of this rank's share; each loss goes through job.backward, so each of the three backward
passes of a batch is reduced (weighted by the ranks' shares) before the optimizer after it steps.

    invoke train --script tests/scripts/ported/gan.py -- --niter 12
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.optim as optim

import hvdhetero as hh  # hh:

parser = argparse.ArgumentParser()
parser.add_argument("--batchSize", type=int, default=128, help="input batch size")
parser.add_argument("--nz", type=int, default=8, help="size of the latent z vector")
parser.add_argument("--ngf", type=int, default=128)
parser.add_argument("--ndf", type=int, default=128)
parser.add_argument("--niter", type=int, default=12, help="number of epochs to train for")
parser.add_argument("--lr", type=float, default=0.002, help="learning rate")
parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")
parser.add_argument("--manualSeed", type=int, default=1, help="manual seed")
opt = parser.parse_args()
print(opt)

torch.manual_seed(opt.manualSeed)
job = hh.init()  # hh:
device = job.device  # hh:
nz, ngf, ndf = opt.nz, opt.ngf, opt.ndf

MODES, STD = 4, 0.05
angles = torch.arange(MODES) * 2 * math.pi / MODES
centers = torch.stack([torch.cos(angles), torch.sin(angles)], 1) * 2.0


def ring(n, seed):
    g = torch.Generator().manual_seed(seed)
    return centers[torch.randint(MODES, (n,), generator=g)] + STD * torch.randn(n, 2, generator=g)


def quality(samples):
    """Modes covered (a fifth of their fair share of good samples at least) and the good share."""
    near, mode = torch.cdist(samples.cpu(), centers).min(1)
    good = near < 3 * STD
    counts = torch.bincount(mode[good], minlength=MODES)
    return int((counts >= 0.2 * len(samples) / MODES).sum()), good.float().mean().item()


dataset = torch.utils.data.TensorDataset(ring(8192, 0))
dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize, shuffle=True)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, ngf), nn.ReLU(True), nn.Linear(ngf, ngf), nn.ReLU(True),
                                  nn.Linear(ngf, 2))

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, ndf), nn.LeakyReLU(0.2, inplace=True), nn.Linear(ndf, ndf),
                                  nn.LeakyReLU(0.2, inplace=True), nn.Linear(ndf, 1), nn.Sigmoid())

    def forward(self, input):
        return self.main(input)


netG = Generator().to(device)
netD = Discriminator().to(device)
criterion = nn.BCELoss()
fixed_noise = torch.randn(2048, nz, device=device)
real_label = 1.0
fake_label = 0.0

optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

(netG, netD), (optimizerD, optimizerG), dataloader = job.prepare(  # hh: both models, both optimizers
    (netG, netD), (optimizerD, optimizerG), dataloader)  # hh:
for epoch in job.epochs(opt.niter):  # hh:
    for i, (data,) in enumerate(dataloader, 0):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data.to(device)
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=device)
        output = netD(real_cpu).view(-1)
        errD_real = criterion(output, label)
        job.backward(errD_real)  # hh:
        D_x = output.mean().item()

        noise = torch.randn(batch_size, nz, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        job.backward(errD_fake)  # hh:
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()

        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        job.backward(errG)  # hh:
        D_G_z2 = output.mean().item()
        optimizerG.step()

    with torch.no_grad():
        modes, good = quality(netG(fixed_noise))
    print(f"[{epoch + 1}/{opt.niter}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} D(x): {D_x:.4f} "
          f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f} modes: {modes}/{MODES} high-quality: {good:.3f}")
