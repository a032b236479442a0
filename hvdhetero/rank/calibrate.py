"""The starting split: each rank's step time measured on the real model before training.

Each rank times its forward/backward at two batch sizes, which separates its per-step overhead
a from its per-sample cost p; every rank's (a, p) reach every rank and set the first split;
then one more probe at exactly that split refines each p (at K=10 the slow rank's share is far
below the small probe, where the straight line through two probes missed by 10-20%, measured).

The probes run the user's model on the user's batches before the first step, so they must not
end the job for our sake: a script that passes no `loss_fn` gets a `ProbeLoss`, which calls the
model as training loops do for the common batch and output shapes, and a probe that raises
anyway (on any rank) leaves every rank on the equal split, balanced from the first steps'
timings (rank/job.py says so once).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from statistics import stdev

import horovod.torch as hvd
import torch
from torch.nn.parameter import is_lazy

from hvdhetero.errors import ConfigError, briefly
from hvdhetero.rank import batches, checkpoint
from hvdhetero.policy.balancer import Balancer
from hvdhetero.rank.host import one_hot
from hvdhetero.rank.collectives import allreduce_sum
from hvdhetero.rank.worker import Worker, cross_entropy_loss, forward_backward


def timings(model, dataset, me: Worker, small: int, big: int, loss_fn: Callable,
            collate_fn: Callable | None = None) -> tuple[float, float, float, tuple[tuple[int, float], ...]]:
    """This rank's per-step overhead a and per-sample seconds p, from probes at two batch sizes,
    the noise of a probe (the larger standard error of the two), and the probes themselves
    ((samples, seconds) each). Runs the user's model alone (no collective): it may raise
    whatever the model raises."""
    t_small, noise_small = probe_seconds(model, dataset, me, small, loss_fn, collate_fn)
    t_big, noise_big = probe_seconds(model, dataset, me, big, loss_fn, collate_fn)
    p = (t_big - t_small) / (big - small) if big > small else t_big / big
    p = max(p, 0.1 * t_big / big)  # timing noise must not make p vanish
    return max(0.0, t_big - p * big), p, max(noise_small, noise_big), ((small, t_small), (big, t_big))


def calibrate(balancer: Balancer, model, dataset, me: Worker, small: int, big: int,
              loss_fn: Callable = cross_entropy_loss, collate_fn: Callable | None = None) -> None:
    """Set `balancer`'s split from this rank's timings and every other rank's (a collective)."""
    split_from(balancer, model, dataset, me, *timings(model, dataset, me, small, big, loss_fn, collate_fn),
               loss_fn=loss_fn, collate_fn=collate_fn)


def split_from(balancer: Balancer, model, dataset, me: Worker, a: float, p: float, noise: float,
               probes: tuple[tuple[int, float], ...], loss_fn: Callable, collate_fn: Callable | None = None) -> None:
    """Set `balancer`'s split from this rank's (a, p) and every other rank's (a collective), then
    refine it with one probe at exactly that split, each rank's line drawn through that probe and
    the one of its two `probes` farthest from its share; each with the probes' noise, so that
    ranks which time alike within it keep the split they have. A rank whose refining probe fails
    sends -1: then every rank keeps the two-probe split (the first steps' timings correct it)."""
    n = hvd.size()
    every = allreduce_sum(one_hot(a) + one_hot(p) + one_hot(noise), "hvdhetero.calibrate")
    balancer.calibrate(every[:n], every[n:2 * n], noise=every[2 * n:])
    sizes = list(balancer.split)
    share = sizes[hvd.rank()]
    try:
        mine, noise = probe_seconds(model, dataset, me, share, loss_fn, collate_fn)
    except Exception as err:  # noqa: BLE001 - the user's model at another batch size (out of memory, say)
        mine, noise = -1.0, 0.0
        print(f"hvdhetero: rank {hvd.rank()}: the probe at its share ({share} samples) failed "
              f"({probe_error(err)}); every rank keeps the calibrated split, and its first steps may fail alike",
              flush=True)
    far, far_s = max(probes, key=lambda probe: abs(probe[0] - share))
    measured = allreduce_sum(one_hot(mine) + one_hot(noise) + one_hot(far) + one_hot(far_s), "hvdhetero.refine")
    if min(measured[:n]) >= 0:
        balancer.refine(measured[:n], sizes, noise=measured[n:2 * n],
                        anchors=list(zip(measured[2 * n:3 * n], measured[3 * n:])))


def probe_seconds(model, dataset, me: Worker, n: int, loss_fn: Callable = cross_entropy_loss,
                  collate_fn: Callable | None = None, steps: int = 5) -> tuple[float, float]:
    """This rank's compute time (forward + backward, straggling included) for n samples of the
    real model: the median of a few probes after one warm-up, and its standard error (the
    probes' spread). The model is left unchanged."""
    batch = batches.probe_chunks(dataset, n, me.micro_batch, me.device.torch_device, collate_fn,
                                 batches.fewest_samples(model))
    times = [forward_backward(model, batch, me, loss_fn=loss_fn)[1] for _ in range(steps + 1)][1:]
    model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2], stdev(times) / len(times) ** 0.5


def materialize(model, dataset, device, collate_fn: Callable | None = None, loss_fn: Callable | None = None) -> None:
    """A model with lazy modules (nn.LazyLinear, nn.LazyConv2d: parameters shaped by the first
    forward) gets that forward now, on two samples of the dataset, in eval mode and without
    gradients, called by `loss_fn` if given, else as a training loop calls it (`ways`): job.prepare
    gives every rank rank 0's parameters, which torch refuses for one not yet shaped
    ("Attempted to use an uninitialized parameter"), as a script that prepared its model before
    its first forward found. The optimizer made before holds the same parameters, shaped now."""
    if not any(is_lazy(t) for t in (*model.parameters(), *model.buffers())):  # LazyBatchNorm's may be buffers only
        return
    batch = batches.probe(dataset, min(2, len(dataset)), device, collate_fn)
    was_training = model.training
    model.eval()  # BatchNorm's running statistics untouched, no dropout
    try:
        with torch.no_grad():
            loss_fn(model, batch) if loss_fn is not None else first_way(model, batch)
    except Exception as err:  # noqa: BLE001 - the user's model, called as it may not be
        if loss_fn is None and not wrong_call(err):
            raise
        raise ConfigError(f"job.prepare(): the model has lazy modules (nn.LazyLinear, ...) whose parameters its "
                          f"first forward shapes, and calling it on two samples failed ({type(err).__name__}: {err}): "
                          "call the model once on a batch before job.prepare(), or pass loss_fn=") from err
    finally:
        model.train(was_training)


def wrong_call(err: Exception) -> bool:
    """Whether `err` is what a model raises when called the wrong way (an argument missing, a
    dict where a tensor goes, shapes that do not multiply): the probe tries the next way. Out of
    memory or a device error ends the probe at once (no other way would fare better)."""
    text = str(err)
    if "out of memory" in text or "CUDA error" in text:  # CUDA and MPS say so in their messages
        return False
    return isinstance(err, (TypeError, AttributeError, KeyError, IndexError, ValueError, RuntimeError,
                            AssertionError))  # torchvision's detection models: "targets should not be none ..."


class ProbeLoss:
    """Calibration's stand-in for the script's loss when `prepare` got no `loss_fn`: the model
    called the way a training loop calls it on such a batch, and a scalar to backpropagate from
    what it returns (`output_loss`). The ways to call it (`ways`) are tried in order on the first
    probe while they fail as a wrong call does (`wrong_call`); the first that runs is kept for
    the rest. Any other error (out of memory, a device error) is raised at once, as is the first
    way's error if none runs: prepare then starts from an equal split."""

    def __init__(self):
        self.way: Callable | None = None

    def __call__(self, model, batch) -> torch.Tensor:
        if self.way is not None:
            return output_loss(self.way(model, batch))
        self.way, loss = first_way(model, batch, output_loss)
        return loss


class SeveralModels:
    """Calibration's probe when job.prepare got several models (a GAN's) and no `loss_fn`: no
    default way calls them as the script's step does, so it says so (prepare starts from an equal
    split and balances from the first steps' timings)."""

    def __init__(self, count: int):
        self.count = count

    def __call__(self, model, batch) -> torch.Tensor:
        raise NotImplementedError(f"job.prepare got {self.count} models, which no default probe calls as your "
                                  "step does")


def first_way(model, batch, then: Callable = lambda out: out) -> tuple[Callable, object]:
    """The first of `ways` that runs, `then` applied to what the model returns (a way whose call or
    `then` fails as a wrong call does gives way to the next), and that result. Any other error is
    raised at once, as is the first way's error if none runs, with the calls tried (`tried`:
    probe_error says them)."""
    first: Exception | None = None
    tried: list[str] = []
    for way in ways(model, batch):
        try:
            return way, then(way(model, batch))
        except Exception as err:  # noqa: BLE001 - the user's model, called as it may not be
            if not wrong_call(err):
                raise
            tried.append(way.call)
            first = first or err.with_traceback(None)  # keeps no activations of the failed call
    first.hvdhetero_tried = tried
    raise first


TARGETS = {"label", "labels", "target", "targets", "y"}
"""Keys a dict batch's targets go by: tried last as the model's input (labels of -100 would index
an embedding out of range)."""


def _way(call: str, fn: Callable) -> Callable:
    """`fn(model, batch)`, with the call it makes in words (`model(batch[0])`) for a probe's error."""
    fn.call = call
    return fn


def ways(model, batch) -> list[Callable]:
    """How a training loop may call `model` on `batch`, likeliest first:
    - a dict, or a namedtuple, whose keys `forward` takes as keywords (Hugging Face style:
      input_ids, attention_mask, labels): `model(**batch)`;
    - a dict: `model(batch)`, then `model(batch[key])` for each tensor in it, floating-point
      first and targets last ({"pixels": ..., "label": ...} -> `model(batch["pixels"])`);
    - a tuple or list (inputs, targets), a namedtuple too: `model(batch[0])`, then images flattened
      (`model(batch[0].flatten(1))`: an MLP whose loop does `data.view(data.size(0), -1)`, as
      Optuna's and MNIST's examples), then all but the last
      (`model(x, lengths)`), then all but the first (targets first: torchtext's tutorials' `(label,
      text, offsets)` -> `model(text, offsets)`), then all of it;
    - a dataclass: as a dict of its fields (`model(**fields)`, `model(batch)`, `model(batch.x)`);
    - a tensor: `model(batch)`;
    - last, where forward requires more positional arguments than the inputs, None for the rest
      (a recurrent model's `forward(input, hidden)`, whose nn.LSTM or nn.GRU starts from zeros
      for a hidden state of None: word_language_model's)."""
    found: list[Callable] = []
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):  # a dataclass batch: as a dict of its fields
        names = [f.name for f in dataclasses.fields(batch)]
        if _takes(model, names):
            found.append(_way("model(**fields)", lambda m, b: m(**{k: getattr(b, k) for k in names})))
        found.append(_way("model(batch)", lambda m, b: m(b)))
        tensors = [k for k in names if isinstance(getattr(batch, k), torch.Tensor)]
        tensors.sort(key=lambda k: (not getattr(batch, k).is_floating_point(), k.lower() in TARGETS))
        return found + [_way(f"model(batch.{k})", lambda m, b, k=k: m(getattr(b, k))) for k in tensors]
    if isinstance(batch, Mapping):
        if _takes(model, batch.keys()):
            found.append(_way("model(**batch)", lambda m, b: m(**b)))
        found.append(_way("model(batch)", lambda m, b: m(b)))
        tensors = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]
        tensors.sort(key=lambda k: (not batch[k].is_floating_point(), str(k).lower() in TARGETS))
        found += [_way(f"model(batch[{k!r}])", lambda m, b, k=k: m(b[k])) for k in tensors]
        return found
    if isinstance(batch, tuple) and hasattr(batch, "_fields") and _takes(model, batch._fields):
        found.append(_way("model(**batch._asdict())", lambda m, b: m(**b._asdict())))
    if isinstance(batch, (tuple, list)) and batch:
        found.append(_way("model(batch[0])", lambda m, b: m(b[0])))
        if isinstance(batch[0], torch.Tensor) and batch[0].dim() > 2:  # an MLP on images: the loop flattens them
            found.append(_way("model(batch[0].flatten(1))", lambda m, b: m(b[0].flatten(1))))
        if len(batch) > 2:
            found.append(_way("model(*batch[:-1])", lambda m, b: m(*b[:-1])))
        if len(batch) > 1:
            found.append(_way("model(*batch[1:])" if len(batch) > 2 else "model(batch[1])", lambda m, b: m(*b[1:])))
            found.append(_way("model(*batch)", lambda m, b: m(*b)))
        if missing := _missing(model, 1):
            found.append(_way(f"model(batch[0], {', '.join(['None'] * missing)})",
                              lambda m, b: m(b[0], *[None] * missing)))
        return found
    missing = _missing(model, 1)
    return [_way("model(batch)", lambda m, b: m(b))] + (
        [_way(f"model(batch, {', '.join(['None'] * missing)})", lambda m, b: m(b, *[None] * missing))]
        if missing else [])


def _missing(model, given: int) -> int:
    """Positional arguments `model.forward` requires beyond the first `given` (0 where it cannot be told)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return 0
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return max(0, len(required) - given)


def _takes(model, names) -> bool:
    """Whether `model.forward` can be called with exactly these names as keywords."""
    try:
        inspect.signature(model.forward).bind(**dict.fromkeys(names))
    except (TypeError, ValueError):
        return False
    return True


def output_loss(out) -> torch.Tensor:
    """A scalar from a model's output to backpropagate: its own loss where it computed one (a
    `loss` attribute or key holding a tensor, as Hugging Face models return when given labels),
    else the sum of the means of every floating-point tensor in it that needs a gradient (a
    tensor, the items of a tuple, list or dict, a dataclass's fields, `.logits`)."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.requires_grad:
        return loss.float().mean()
    found = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
    if not found:
        raise TypeError(f"the model's output ({type(out).__name__}) holds no floating-point tensor that needs a "
                        "gradient")
    return sum(t.float().mean() for t in found)


def _tensors(out, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if depth > 4:
        return []
    if isinstance(out, Mapping):
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        values = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        values = [getattr(out, "logits", None)]
    return [t for v in values for t in _tensors(v, depth + 1)]


def probe_error(err: BaseException) -> str:
    """An exception of the user's model in a probe, in one short line: where no default way ran,
    the call that raised it and the others tried."""
    tried = getattr(err, "hvdhetero_tried", None)
    if not tried:
        return briefly(err)
    return f"{tried[0]}: {briefly(err)}" + (f"; {', '.join(tried[1:])} failed too" if tried[1:] else "")


def fallback_message(failed: list[str], loss_fn) -> str:
    """The one line rank 0 prints when a probe failed: on which rank, why, what follows, and
    how the script can help (`loss_fn`: job.prepare's, or None)."""
    rank = next(i for i, error in enumerate(failed) if error)
    if isinstance(loss_fn, SeveralModels):
        help_ = ("to time your real step, pass job.prepare(..., loss_fn=lambda models, batch: <a step's losses "
                 "summed>), the models in the order you gave them")
    elif loss_fn is not None:
        help_ = "check the loss_fn given to job.prepare"
    else:
        help_ = "to time your real step, pass job.prepare(..., loss_fn=lambda model, batch: <your loss>)"
    return (f"hvdhetero: could not time the model before training (rank {rank}: {failed[rank]}); starting from "
            f"an equal split, balanced from the first steps' timings; {help_}")


class unchanged:
    """Calibration probes run forward/backward on the real model: put back its buffers
    (BatchNorm statistics) and the random states its dropout drew from (torch's, and the
    `device`'s: a loss_fn's probes moved them, and the run no longer repeated the one-device
    run from the same seed), and leave no gradients."""

    def __init__(self, model, device: str = "cpu"):
        self.model, self.device = model, device

    def __enter__(self):
        self.saved = {k: v.detach().clone() for k, v in self.model.named_buffers()}
        self.rng = checkpoint.rng_state(self.device)

    def __exit__(self, *exc):
        for k, v in self.model.named_buffers():
            v.copy_(self.saved[k])
        self.model.zero_grad(set_to_none=True)
        checkpoint.set_rng_state(self.rng)
