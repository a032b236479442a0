"""ddp_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed, and the lines
that made it distributed went (torchrun's LOCAL_RANK, the process group, the DDP wrapper, the
DistributedSampler and its set_epoch): hvdhetero starts the ranks, deals each its share of the
loader's batch (now the batch of one step across every rank: pass `--batch_size 64` for the
original's 32 on each of two processes) and meets the gradients. Rank 0's snapshot is loaded back
where a rank finds it; job.prepare gives every rank rank 0's model, and job.epochs rank 0's start
(on two machines only rank 0's host holds the file).

    invoke train --script tests/scripts/ported/ddp.py -- 12 4 --batch_size 64

The original: a DDP script as PyTorch's "distributed training with DDP" tutorial series ends it
(multigpu_torchrun.py): torchrun starts the processes, each reads LOCAL_RANK, joins the process
group and wraps its model in DistributedDataParallel; a DistributedSampler deals the data with
`set_epoch` every epoch; a `Trainer` class runs the epochs, and rank 0 saves a snapshot every
few epochs, which every process loads back when the job starts again (torchrun's way of going on
after a failure). Written to run on a CPU as on GPUs (gloo where CUDA is missing), as such
scripts are when their authors try them on a laptop. The data is made up: a smooth function of
twenty features (variance 0.39) plus noise of variance 0.0025 (the best test MSE reachable); rank 0
prints the test MSE every epoch.

    torchrun --standalone --nproc_per_node=2 tests/scripts/ported/ddp_single.py 12 4
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader

import torch.multiprocessing as mp

import hvdhetero as hh  # hh:


class MyTrainDataset(Dataset):
    def __init__(self, size, seed=0):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(20, 4, generator=torch.Generator().manual_seed(1234)) / 20 ** 0.5
        self.x = torch.randn(size, 20, generator=g)
        self.y = torch.sin(self.x @ w).sum(1, keepdim=True) / 2 + 0.05 * torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


job = hh.init()  # hh: in place of ddp_setup(): the rank's device, rank and peers


class Trainer:
    def __init__(self, model, train_data, test_data, optimizer, save_every, snapshot_path):
        self.gpu_id = job.rank  # hh:
        self.device = job.device  # hh: mps, cuda or cpu, per rank
        self.model = model.to(self.device)
        self.train_data = train_data
        self.test_data = test_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model, self.optimizer, self.train_data = job.prepare(self.model, self.optimizer, self.train_data)  # hh:

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        job.backward(loss)  # hh: gradients meet across ranks
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            self._run_batch(source, targets)

    def _test(self, epoch):
        x, y = self.test_data
        with torch.no_grad():
            mse = F.mse_loss(self.model(x.to(self.device)), y.to(self.device)).item()
        print(f"Epoch {epoch} | test MSE {mse:.4f}")

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.state_dict(),  # hh: no DDP wrapper to reach through
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in job.epochs(max_epochs, start=self.epochs_run):  # hh: rank 0's start on every rank
            self._run_epoch(epoch)
            if self.gpu_id == 0:
                self._test(epoch)
            if self.gpu_id == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    train_set = MyTrainDataset(4096)  # load your dataset
    test_set = MyTrainDataset(1024, seed=1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    return train_set, (test_set.x, test_set.y), model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=True,
        shuffle=True,  # hh: in place of the DistributedSampler
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot.pt"):
    dataset, test_data, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, test_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description='simple distributed training job')
    parser.add_argument('total_epochs', type=int, help='Total epochs to train the model')
    parser.add_argument('save_every', type=int, help='How often to save a snapshot')
    parser.add_argument('--batch_size', default=32, type=int, help='Input batch size on each device (default: 32)')
    parser.add_argument('--snapshot_path', default="snapshot.pt", help='Where the snapshot goes')
    args = parser.parse_args()

    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
