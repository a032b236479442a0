"""reference_single.py ported (the lines marked hh:). An image classifier trained the way
torchvision's reference scripts are (references/classification/train.py and utils.py,
shortened): a MetricLogger whose log_every wraps the loader, label smoothing, SGD over parameter
groups, a warm-up and a cosine decay chained in a SequentialLR stepped once an epoch, an EMA of
the weights updated every few batches and evaluated beside the model, checkpoints saved with
save_on_master every epoch and read back by its own --resume, whose epoch to start from goes to
job.epochs(start=). Its init_distributed_mode takes the one-device path (the ranks get no RANK
variable); its is_main_process() becomes job.is_main, so that save_on_master is rank 0's alone.

    invoke train --script tests/scripts/ported/reference.py -- --model-ema --output-dir /tmp/ref
"""

import argparse
import datetime
import os
import time
from collections import defaultdict, deque

import torch
import torch.nn.functional as F
import torchvision
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import hvdhetero as hh  # hh:

job = hh.init()  # hh:

# -----------------------------------------------------------------------------
# utils.py


class SmoothedValue:
    """Track a series of values and provide access to smoothed values over a window or the global average."""

    def __init__(self, window_size=20, fmt=None):
        self.deque = deque(maxlen=window_size)
        self.total, self.count = 0.0, 0
        self.fmt = fmt or "{median:.4f} ({global_avg:.4f})"

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self):
        if not is_dist_avail_and_initialized():
            return
        t = reduce_across_processes([self.count, self.total])
        self.count, self.total = int(t[0]), t[1].item()

    @property
    def median(self):
        return torch.tensor(list(self.deque)).median().item()

    @property
    def global_avg(self):
        return self.total / self.count

    @property
    def value(self):
        return self.deque[-1]

    def __str__(self):
        return self.fmt.format(median=self.median, global_avg=self.global_avg, value=self.value)


class MetricLogger:
    def __init__(self, delimiter="\t"):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            self.meters[k].update(v.item() if isinstance(v, torch.Tensor) else v)

    def __getattr__(self, attr):
        if attr in self.meters:
            return self.meters[attr]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'")

    def __str__(self):
        return self.delimiter.join(f"{name}: {meter}" for name, meter in self.meters.items())

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def log_every(self, iterable, print_freq, header=""):
        i = 0
        start_time = end = time.time()
        iter_time, data_time = SmoothedValue(fmt="{global_avg:.4f}"), SmoothedValue(fmt="{global_avg:.4f}")
        space_fmt = ":" + str(len(str(len(iterable)))) + "d"
        log_msg = self.delimiter.join([header, "[{0" + space_fmt + "}/{1}]", "eta: {eta}", "{meters}",
                                       "time: {time}", "data: {data}"])
        for obj in iterable:
            data_time.update(time.time() - end)
            yield obj
            iter_time.update(time.time() - end)
            if i % print_freq == 0:
                eta_seconds = iter_time.global_avg * (len(iterable) - i)
                eta_string = str(datetime.timedelta(seconds=int(eta_seconds)))
                print(log_msg.format(i, len(iterable), eta=eta_string, meters=str(self), time=str(iter_time),
                                     data=str(data_time)))
            i += 1
            end = time.time()
        total_time = time.time() - start_time
        print(f"{header} Total time: {datetime.timedelta(seconds=int(total_time))}")


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """Maintains moving averages of model parameters using an exponential decay."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def accuracy(output, target, topk=(1,)):
    with torch.inference_mode():
        maxk = max(topk)
        batch_size = target.size(0)
        if target.ndim == 2:
            target = target.max(dim=1)[1]
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target[None])
        return [correct[:k].flatten().sum(dtype=torch.float32) * (100.0 / batch_size) for k in topk]


def is_dist_avail_and_initialized():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_main_process():
    return job.is_main  # hh: rank 0 saves (save_on_master)


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def init_distributed_mode(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    else:
        print("Not using distributed mode")
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    torch.distributed.init_process_group(backend="nccl", init_method="env://", world_size=args.world_size,
                                         rank=args.rank)
    torch.distributed.barrier()


def reduce_across_processes(val):
    if not is_dist_avail_and_initialized():
        return torch.tensor(val)
    t = torch.tensor(val, device="cuda")
    torch.distributed.barrier()
    torch.distributed.all_reduce(t)
    return t


def set_weight_decay(model, weight_decay, norm_weight_decay=None):
    norm_classes = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)
    params = {"other": [], "norm": []}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                params["norm" if norm_weight_decay is not None and isinstance(module, norm_classes)
                       else "other"].append(p)
    groups = [{"params": params["other"], "weight_decay": weight_decay}]
    if params["norm"]:
        groups.append({"params": params["norm"], "weight_decay": norm_weight_decay})
    return groups


# -----------------------------------------------------------------------------
# train.py


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema=None, scaler=None):
    model.train()
    metric_logger = MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value}"))
    metric_logger.add_meter("img/s", SmoothedValue(window_size=10, fmt="{value:.1f}"))
    header = f"Epoch: [{epoch}]"
    for i, (image, target) in enumerate(metric_logger.log_every(data_loader, args.print_freq, header)):
        start_time = time.time()
        image, target = image.to(device), target.to(device)
        with torch.autocast(device.type, enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad()
        if scaler is not None:
            job.backward(scaler.scale(loss))  # hh:
            scaler.step(optimizer)
            scaler.update()
        else:
            job.backward(loss)  # hh:
            if args.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()
        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)  # reset ema buffer to keep copying weights during warmup period
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        batch_size = image.shape[0]
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
        metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)
        metric_logger.meters["img/s"].update(batch_size / (time.time() - start_time))


def evaluate(model, criterion, data_loader, device, print_freq=100, log_suffix=""):
    model.eval()
    metric_logger = MetricLogger(delimiter="  ")
    header = f"Test: {log_suffix}"
    num_processed_samples = 0
    with torch.inference_mode():
        for image, target in metric_logger.log_every(data_loader, print_freq, header):
            image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
            output = model(image)
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            batch_size = image.shape[0]
            metric_logger.update(loss=loss.item())
            metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
            metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)
            num_processed_samples += batch_size
    num_processed_samples = reduce_across_processes(num_processed_samples)
    metric_logger.synchronize_between_processes()
    print(f"{header} Acc@1 {metric_logger.acc1.global_avg:.3f} Acc@5 {metric_logger.acc5.global_avg:.3f}")
    return metric_logger.acc1.global_avg


def load_data():
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=16, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    images = (images - 0.5) / 0.5
    labels = torch.tensor(digits.target)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(labels), generator=gen)
    train, test = order[:1500], order[1500:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def main(args):
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
    init_distributed_mode(args)
    print(args)
    device = job.device  # hh: this rank's device
    torch.manual_seed(args.seed)

    dataset, dataset_test = load_data()
    train_sampler = torch.utils.data.RandomSampler(dataset)
    test_sampler = torch.utils.data.SequentialSampler(dataset_test)
    data_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler,
                                              num_workers=args.workers, pin_memory=True)
    data_loader_test = torch.utils.data.DataLoader(dataset_test, batch_size=args.batch_size, sampler=test_sampler,
                                                   num_workers=args.workers, pin_memory=True)

    print("Creating model")
    model = torchvision.models.get_model(args.model, weights=None, num_classes=10)
    model.to(device)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    parameters = set_weight_decay(model, args.weight_decay, norm_weight_decay=args.norm_weight_decay)
    optimizer = torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type) if args.amp else None
    main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs,
                                                                   eta_min=args.lr_min)
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=args.lr_warmup_decay,
                                                            total_iters=args.lr_warmup_epochs)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler],
                                                         milestones=[args.lr_warmup_epochs])

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    model_ema = None
    if args.model_ema:
        adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
        alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
        model_ema = ExponentialMovingAverage(model_without_ddp, device=device, decay=1.0 - alpha)

    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        if model_ema:
            model_ema.load_state_dict(checkpoint["model_ema"])
        if scaler:
            scaler.load_state_dict(checkpoint["scaler"])

    model, optimizer, data_loader = job.prepare(model, optimizer, data_loader, scheduler=lr_scheduler)  # hh:
    print("Start training")
    start_time = time.time()
    for epoch in job.epochs(args.epochs, start=args.start_epoch):  # hh:
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler)
        lr_scheduler.step()
        evaluate(model, criterion, data_loader_test, device=device)
        if model_ema:
            evaluate(model_ema, criterion, data_loader_test, device=device, log_suffix="EMA")
        if args.output_dir:
            checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                          "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch}
            if model_ema:
                checkpoint["model_ema"] = model_ema.state_dict()
            if scaler:
                checkpoint["scaler"] = scaler.state_dict()
            save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
    total_time_str = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    print(f"Training time {total_time_str}")


def get_args_parser():
    parser = argparse.ArgumentParser(description="PyTorch Classification Training")
    parser.add_argument("--model", default="resnet18", type=str)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=str)
    parser.add_argument("-b", "--batch-size", default=64, type=int)
    parser.add_argument("--epochs", default=8, type=int)
    parser.add_argument("-j", "--workers", default=0, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--norm-weight-decay", default=0.0, type=float)
    parser.add_argument("--label-smoothing", default=0.1, type=float)
    parser.add_argument("--lr-warmup-epochs", default=2, type=int)
    parser.add_argument("--lr-warmup-decay", default=0.1, type=float)
    parser.add_argument("--lr-min", default=0.0, type=float)
    parser.add_argument("--print-freq", default=10, type=int)
    parser.add_argument("--output-dir", default="", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--world-size", default=1, type=int)
    parser.add_argument("--model-ema", action="store_true")
    parser.add_argument("--model-ema-steps", type=int, default=4)
    parser.add_argument("--model-ema-decay", type=float, default=0.99)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--clip-grad-norm", default=None, type=float)
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
