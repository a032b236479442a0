"""transfer_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed. The
training DataLoader goes to job.prepare (its batch_size, shuffle and 4 workers kept), the
validation one stays as it was: every rank evaluates the whole validation set, on the one model
(its BatchNorm statistics averaged as the training loop ends), so every rank prints the same
validation figures and keeps the same best weights. The training phase's running sums count this
rank's share of the epoch: job.reduce sums them over the ranks before they are divided by the
dataset's size.

    invoke train --script tests/scripts/ported/transfer.py -- --data-dir /tmp/hymenoptera_data --epochs 5
"""

import argparse
import os
import shutil
import time
from tempfile import TemporaryDirectory

import torch
import torch.nn as nn
import torch.optim as optim
from PIL import Image
from torch.optim import lr_scheduler
from torchvision import datasets, models, transforms

import hvdhetero as hh  # hh:


def write_stand_in(data_dir, per_class=(("train", 40), ("val", 20))):
    """What the tutorial downloads: data_dir/{train,val}/{ants,bees}/*.png. Written whole under
    another name and renamed, so that a reader never sees half of it."""
    if os.path.isdir(data_dir):
        return
    g = torch.Generator().manual_seed(0)
    staging = f"{data_dir}.{os.getpid()}"
    for phase, n in per_class:
        for label, name in enumerate(["ants", "bees"]):
            os.makedirs(os.path.join(staging, phase, name))
            for i in range(n):
                period = int(torch.randint(6, 12, (1,), generator=g))
                stripes = (torch.arange(64) % period < period // 2).float()
                stripes = stripes.view(64, 1).expand(64, 64) if label == 0 else stripes.view(1, 64).expand(64, 64)
                color = 0.3 + 0.7 * torch.rand(3, 1, 1, generator=g)
                pixels = 0.5 * stripes * color + 0.5 * torch.rand(3, 64, 64, generator=g)
                array = (pixels.permute(1, 2, 0) * 255).to(torch.uint8).numpy()
                Image.fromarray(array).save(os.path.join(staging, phase, name, f"{i}.png"))
    try:
        os.rename(staging, data_dir)
    except OSError:  # another process wrote it first
        shutil.rmtree(staging)


def train_model(model, criterion, optimizer, scheduler, num_epochs=25):
    since = time.time()

    with TemporaryDirectory() as tempdir:
        best_model_params_path = os.path.join(tempdir, "best_model_params.pt")

        torch.save(model.state_dict(), best_model_params_path)
        best_acc = 0.0

        for epoch in job.epochs(num_epochs):  # hh:
            print(f"Epoch {epoch}/{num_epochs - 1}")
            print("-" * 10)

            for phase in ["train", "val"]:
                if phase == "train":
                    model.train()
                else:
                    model.eval()

                running_loss = 0.0
                running_corrects = 0

                for inputs, labels in dataloaders[phase]:
                    inputs = inputs.to(device)
                    labels = labels.to(device)

                    optimizer.zero_grad()

                    with torch.set_grad_enabled(phase == "train"):
                        outputs = model(inputs)
                        _, preds = torch.max(outputs, 1)
                        loss = criterion(outputs, labels)

                        if phase == "train":
                            job.backward(loss)  # hh: gradients meet across ranks
                            optimizer.step()

                    running_loss += loss.item() * inputs.size(0)
                    running_corrects += torch.sum(preds == labels.data)
                if phase == "train":
                    scheduler.step()
                    running_loss, running_corrects = job.reduce((running_loss, running_corrects))  # hh: every rank's share

                epoch_loss = running_loss / dataset_sizes[phase]
                epoch_acc = running_corrects.double() / dataset_sizes[phase]

                print(f"{phase} Loss: {epoch_loss:.4f} Acc: {epoch_acc:.4f}")

                if phase == "val" and epoch_acc > best_acc:
                    best_acc = epoch_acc
                    torch.save(model.state_dict(), best_model_params_path)

            print()

        time_elapsed = time.time() - since
        print(f"Training complete in {time_elapsed // 60:.0f}m {time_elapsed % 60:.0f}s")
        print(f"Best val Acc: {best_acc:4f}")

        model.load_state_dict(torch.load(best_model_params_path, weights_only=True))
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="data/hymenoptera_data")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    data_transforms = {
        "train": transforms.Compose([
            transforms.RandomResizedCrop(48, scale=(0.5, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]),
        "val": transforms.Compose([
            transforms.Resize(56),
            transforms.CenterCrop(48),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]),
    }

    write_stand_in(args.data_dir)
    data_dir = args.data_dir
    image_datasets = {x: datasets.ImageFolder(os.path.join(data_dir, x), data_transforms[x])
                      for x in ["train", "val"]}
    dataloaders = {x: torch.utils.data.DataLoader(image_datasets[x], batch_size=4, shuffle=True, num_workers=4)
                   for x in ["train", "val"]}
    dataset_sizes = {x: len(image_datasets[x]) for x in ["train", "val"]}
    class_names = image_datasets["train"].classes

    job = hh.init()  # hh:
    device = job.device  # hh: mps, cuda or cpu, per rank
    print(f"Using {device} device")

    torch.manual_seed(0)
    model_ft = models.resnet18(weights=None)  # the tutorial's weights="IMAGENET1K_V1": no download here
    num_ftrs = model_ft.fc.in_features
    model_ft.fc = nn.Linear(num_ftrs, len(class_names))

    model_ft = model_ft.to(device)

    criterion = nn.CrossEntropyLoss()

    optimizer_ft = optim.SGD(model_ft.parameters(), lr=0.005, momentum=0.9)

    exp_lr_scheduler = lr_scheduler.StepLR(optimizer_ft, step_size=3, gamma=0.1)
    model_ft, optimizer_ft, dataloaders["train"] = job.prepare(model_ft, optimizer_ft, dataloaders["train"])  # hh:

    model_ft = train_model(model_ft, criterion, optimizer_ft, exp_lr_scheduler, num_epochs=args.epochs)
