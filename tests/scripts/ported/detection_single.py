"""An object detector the way the TorchVision Object Detection Finetuning Tutorial trains one: a
dataset whose samples are an image and a target dict (boxes, labels, image_id, area, iscrowd),
`collate_fn=lambda batch: tuple(zip(*batch))` (a batch is a tuple of images and a tuple of target
dicts, not stacked tensors), a Faster R-CNN built on a backbone of its own with an
AnchorGenerator and a MultiScaleRoIAlign, a model that returns its dict of losses in training
mode, SGD over the parameters that require gradients, a linear warm-up stepped every iteration of
the first epoch, a StepLR stepped every epoch, and the loop of the references' engine.py
(`train_one_epoch`: `loss_dict = model(images, targets)`, a non-finite loss ends the run). Images
of one to three bright rectangles on noise stand in for Penn-Fudan (no download), and the
evaluation is the recall and precision of the boxes at IoU 0.5 (no pycocotools).

    python tests/scripts/ported/detection_single.py --epochs 4
"""

import argparse
import math
import sys

import torch
import torchvision
from torch import nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.rpn import AnchorGenerator


class Rectangles(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(self.seed * 100_003 + idx)
        img = torch.rand(3, 64, 64, generator=g) * 0.3
        boxes = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            w, h = (int(v) for v in torch.randint(10, 24, (2,), generator=g))
            x0, y0 = int(torch.randint(0, 64 - w, (1,), generator=g)), int(torch.randint(0, 64 - h, (1,), generator=g))
            img[:, y0:y0 + h, x0:x0 + w] = 0.6 + 0.4 * torch.rand(3, 1, 1, generator=g)
            boxes.append([x0, y0, x0 + w, y0 + h])
        boxes = torch.tensor(boxes, dtype=torch.float32)
        target = {
            "boxes": boxes,
            "labels": torch.ones((len(boxes),), dtype=torch.int64),
            "image_id": idx,
            "area": (boxes[:, 3] - boxes[:, 1]) * (boxes[:, 2] - boxes[:, 0]),
            "iscrowd": torch.zeros((len(boxes),), dtype=torch.int64),
        }
        return img, target


def collate_fn(batch):
    return tuple(zip(*batch))


def get_model(num_classes):
    backbone = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
    )
    backbone.out_channels = 32
    anchor_generator = AnchorGenerator(sizes=((12, 16, 24),), aspect_ratios=((0.5, 1.0, 2.0),))
    roi_pooler = torchvision.ops.MultiScaleRoIAlign(featmap_names=["0"], output_size=7, sampling_ratio=2)
    return FasterRCNN(backbone, num_classes=num_classes, rpn_anchor_generator=anchor_generator,
                      box_roi_pool=roi_pooler, min_size=64, max_size=64, representation_size=64,
                      rpn_pre_nms_top_n_train=100, rpn_post_nms_top_n_train=50, rpn_pre_nms_top_n_test=100,
                      rpn_post_nms_top_n_test=50, rpn_batch_size_per_image=64, box_batch_size_per_image=32)


def train_one_epoch(model, optimizer, data_loader, device, epoch, print_freq):
    model.train()
    lr_scheduler = None
    if epoch == 0:
        warmup_factor = 1.0 / 1000
        warmup_iters = min(1000, len(data_loader) - 1)
        lr_scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=warmup_factor, total_iters=warmup_iters
        )
    total, count = 0.0, 0
    for i, (images, targets) in enumerate(data_loader):
        images = list(image.to(device) for image in images)
        targets = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]
        loss_dict = model(images, targets)
        losses = sum(loss for loss in loss_dict.values())
        loss_value = losses.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            print(loss_dict)
            sys.exit(1)
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        total, count = total + loss_value, count + 1
        if i % print_freq == 0:
            print(f"Epoch: [{epoch}] [{i}/{len(data_loader)}] loss: {loss_value:.4f} "
                  f"lr: {optimizer.param_groups[0]['lr']:.6f}")
    print(f"Epoch: [{epoch}] mean loss: {total / count:.4f}")


def box_iou(a, b):
    return torchvision.ops.box_iou(a, b) if len(a) and len(b) else torch.zeros(len(a), len(b))


@torch.inference_mode()
def evaluate(model, data_loader, device):
    model.eval()
    found = objects = kept = right = 0
    for images, targets in data_loader:
        outputs = model(list(img.to(device) for img in images))
        for out, target in zip(outputs, targets):
            boxes = out["boxes"][out["scores"] > 0.5].cpu()
            iou = box_iou(target["boxes"], boxes)
            found += int((iou.max(1).values >= 0.5).sum()) if len(boxes) else 0
            right += int((iou.max(0).values >= 0.5).sum()) if len(boxes) else 0
            objects, kept = objects + len(target["boxes"]), kept + len(boxes)
    print(f"Test: recall {found / objects:.3f} precision {right / max(kept, 1):.3f}")


def main():
    parser = argparse.ArgumentParser(description="Faster R-CNN on rectangles")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    dataset = Rectangles(240, seed=0)
    dataset_test = Rectangles(100, seed=1)
    data_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                              collate_fn=collate_fn)
    data_loader_test = torch.utils.data.DataLoader(dataset_test, batch_size=8, shuffle=False,
                                                   collate_fn=collate_fn)

    model = get_model(num_classes=2)
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=0.0005)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.1)

    for epoch in range(args.epochs):
        train_one_epoch(model, optimizer, data_loader, device, epoch, print_freq=10)
        lr_scheduler.step()
        evaluate(model, data_loader_test, device=device)
    print("That's it!")


if __name__ == "__main__":
    main()
