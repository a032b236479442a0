"""accelerate_cv_single.py ported to hvdhetero, name for name as docs/api.md's "From an Accelerate
script" maps them: the lines marked `# hh:` are all that changed. The evaluation loader stays as
made (each rank evaluates the whole set on the one model: nothing to gather); `--mixed_precision`
is `invoke train --precision`'s now.

    invoke train --script tests/scripts/ported/accelerate_cv.py
"""

import argparse

import torch

import hvdhetero as hh  # hh: in place of accelerate's two
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, Dataset


class DigitsDataset(Dataset):
    def __init__(self, train):
        images, labels = load_digits(return_X_y=True)
        part = slice(0, 1500) if train else slice(1500, None)
        self.images = torch.tensor(images[part] / 16, dtype=torch.float32).reshape(-1, 1, 8, 8)
        self.labels = torch.tensor(labels[part])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        return {"image": self.images[idx], "label": self.labels[idx]}


def create_model(num_classes):
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 2 * 2, num_classes))


def training_function(config, args):
    # Initialize accelerator
    job = hh.init()  # hh: (--precision on invoke train for mixed precision)

    # Sample hyper-parameters for learning rate, batch size, seed and a few other HPs
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    # Set the seed before splitting the data.
    torch.manual_seed(seed)  # hh:

    # Build the datasets
    train_dataset = DigitsDataset(train=True)
    eval_dataset = DigitsDataset(train=False)

    # Instantiate dataloaders.
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=batch_size, num_workers=2)
    eval_dataloader = DataLoader(eval_dataset, shuffle=False, batch_size=batch_size, num_workers=2)

    # Instantiate the model (we build the model here so that the seed also control new weights initialization)
    model = create_model(10)

    # We could avoid this line since the accelerator is set with `device_placement=True` (default value).
    model = model.to(job.device)  # hh:

    # Instantiate optimizer
    optimizer = torch.optim.Adam(params=model.parameters(), lr=lr / 25)

    # Instantiate learning rate scheduler
    lr_scheduler = OneCycleLR(optimizer=optimizer, max_lr=lr, epochs=num_epochs, steps_per_epoch=len(train_dataloader))

    # Prepare everything
    model, optimizer, train_dataloader = job.prepare(  # hh: the evaluation loader stays as made
        model, optimizer, train_dataloader, scheduler=lr_scheduler  # hh: stepped every batch, as it was
    )

    # Now we train the model
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(batch["image"])
            loss = torch.nn.functional.cross_entropy(outputs, batch["label"])
            job.backward(loss)  # hh:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

        model.eval()
        accurate = 0
        num_elems = 0
        for _, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(batch["image"])
            predictions = outputs.argmax(dim=-1)
            references = batch["label"]  # hh: each rank evaluates the whole set
            accurate_preds = predictions == references
            num_elems += accurate_preds.shape[0]
            accurate += accurate_preds.long().sum()

        eval_metric = accurate.item() / num_elems
        # Use accelerator.print to print only on the main process.
        print(f"epoch {epoch}: {100 * eval_metric:.2f}")  # hh: rank 0's reach the console


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"],
                        help="Whether to use mixed precision.")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    config = {"lr": 3e-2, "num_epochs": 3, "seed": 42, "batch_size": 64}
    training_function(config, args)


if __name__ == "__main__":
    main()
