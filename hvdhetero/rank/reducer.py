"""Gradient reduction on the CPU through Horovod/Gloo, for MPS, CUDA and CPU ranks alike.

Every gradient is copied into one fused CPU buffer (one allreduce per step instead of one per
tensor), scaled by this rank's weight w_i = n_i / sum(n) (its share of the step's samples),
summed across ranks with `op=Sum`, and copied back to the device. A flag per parameter rides
along (whether the rank held a gradient for it): a parameter no rank's backward reached keeps
no gradient, as on one device. Per-rank weights cannot go
through Horovod's `prescale_factor` (it rejects factors that differ across ranks), hence the
local scaling. Copies between device and CPU are blocking: non_blocking MPS<->CPU copies have
returned wrong data in other projects. On a CUDA or MPS rank a bucket's gradients are first
gathered into one flat buffer on the device (`staged`), so that a bucket crosses to the CPU in one
copy and back in one: a blocking copy a parameter waited for the device at each of them, and the
device ran dry while the next kernels were queued (on the H200 machine a CUDA rank's ResNet-18
step computed 43.5 ms under step sync against 14.5 ms alone, where 62 parameters each crossed
twice). A CUDA rank's CPU buffers are pinned (page-locked), which copies take at full speed. Both
are made at a bucket's first reduction: under local/diloco, which never reduce, they take nothing.

Our Horovod is a CPU-only build, so every tensor handed to it here is a CPU tensor; that is
also why parameters are broadcast through CPU copies rather than `hvd.broadcast_parameters`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import horovod.torch as hvd
import torch

from hvdhetero.rank.collectives import allreduce_, broadcast_, broadcast_object, patient_timeout_s, wait

WIRE_DTYPES = {"none": torch.float32, "fp16": torch.float16}


@dataclass
class _Bucket:
    """A run of parameters reduced as one CPU message (one allreduce): their gradients (`buffer`),
    then one flag each (`used`), how many ranks held a gradient for it."""

    params: list[torch.nn.Parameter]
    message: torch.Tensor
    wire: torch.Tensor | None
    name: str
    sparse: frozenset = frozenset()
    """ids of the parameters whose gradients go back sparse (sparse_params)."""
    device: torch.device | None = None
    """Where a CUDA or MPS rank's gradients are gathered before they cross (None: into the CPU buffer)."""
    staged: torch.Tensor | None = None
    """Their flat copy there, made at the first pack (local/diloco never reduce: no memory for it),
    in the gradients' own dtype where they share one (a bf16 model's crosses in half the bytes; the
    CPU buffer's float32 takes it exactly)."""
    pin: bool = True
    """Whether the CPU buffer is page-locked once a device's gradients cross (CUDA: copies at full speed)."""
    waiting: int = 0
    handle: object = None
    buffer: torch.Tensor = field(init=False)
    """The gradients: the message less its flags."""
    used: torch.Tensor = field(init=False)

    def __post_init__(self):
        self._views()

    def _views(self) -> None:
        self.buffer, self.used = self.message.split([self.message.numel() - len(self.params), len(self.params)])

    def _stage(self) -> None:
        dtypes = {p.dtype for p in self.params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.staged = torch.zeros(self.buffer.numel(), dtype=dtype if dtype.is_floating_point else torch.float32,
                                  device=self.device)
        if self.pin and self.device.type == "cuda":  # page-locked: the copies from and to the GPU at full speed
            self.message = self.message.pin_memory()
            self._views()

    def pack(self, weight: float) -> None:
        if self.device is not None and self.staged is None:
            self._stage()
        flat = self.staged if self.staged is not None else self.buffer
        chunks = flat.split([p.numel() for p in self.params])
        for p, chunk in zip(self.params, chunks):
            if p.grad is None:
                chunk.zero_()  # e.g. a rank that had no samples this step: contributes nothing
            elif p.grad.is_sparse:  # nn.Embedding(sparse=True): the rows it touched; summed as a whole table
                chunk.copy_(p.grad.detach().to_dense().reshape(-1))
            else:
                chunk.copy_(p.grad.detach().reshape(-1))
        if self.staged is not None:
            self.buffer.copy_(self.staged)  # the bucket to the CPU in one blocking copy
        self.buffer.mul_(weight)
        self.used.copy_(torch.tensor([p.grad is not None for p in self.params], dtype=self.used.dtype))

    def launch(self, weight: float) -> None:
        self.pack(weight)
        if self.wire is not None:
            self.wire.copy_(self.message)
        # Horovod: asynchronous named allreduce; names match across ranks, order need not.
        self.handle = hvd.allreduce_async_(self.wire if self.wire is not None else self.message,
                                           op=hvd.Sum, name=self.name)

    def finish(self, after: float = 1.0) -> None:
        wait(self.handle, "its gradients' reduction")
        self.handle = None
        if self.wire is not None:
            self.message.copy_(self.wire)
        if after != 1.0:
            self.buffer.mul_(after)
        sizes = [p.numel() for p in self.params]
        if self.staged is not None:
            self.staged.copy_(self.buffer)  # back to the device in one copy
        back = (self.staged if self.staged is not None else self.buffer).split(sizes)
        for p, chunk, there, used in zip(self.params, self.buffer.split(sizes), back, self.used.tolist()):
            if not used:  # no rank's backward reached it (an expert no sample chose): no gradient, as on one
                p.grad = None  # device, where Adam and weight decay leave such a parameter alone
                continue
            if id(p) in self.sparse:  # back as sparse on every rank (SparseAdam wants so), the rows any rank touched
                p.grad = chunk.view_as(p).to_sparse(1).to(p.device)
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(there.view_as(p))


LAYOUTS_KEPT = 4
"""Trainable sets whose buckets a Reducer keeps (the newest)."""


class Reducer:
    """Weighted allreduce of all gradients of `params` through fused CPU buffers.

    Without overlap, every gradient goes into one buffer after backward. With `overlap=True`
    the parameters are cut into buckets of about `bucket_mb` (in reverse order, as backward
    produces them); a bucket's allreduce starts as soon as its last gradient is accumulated,
    while backward still runs. Call `prepare(weight)` before backward in that mode; with
    micro-batches, right before the last chunk's backward (earlier chunks only accumulate).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], compression: str = "none",
                 overlap: bool = False, bucket_mb: float = 0.5, sparse: frozenset = frozenset(),
                 stage: bool | None = None, pin: bool = True):
        if compression not in WIRE_DTYPES:
            raise ValueError(f"compression must be one of {sorted(WIRE_DTYPES)}, got {compression!r}")
        params = list(params)
        self.params = [p for p in params if p.requires_grad]
        self.known = {id(p) for p in params}
        """Every parameter prepare saw (and gave every rank rank 0's of), trainable or not."""
        self.wire_dtype = WIRE_DTYPES[compression]
        self.overlap, self.bucket_mb, self.sparse = overlap, bucket_mb, sparse
        self.stage, self.pin = stage, pin
        """Gather each bucket on its parameters' device before it crosses (None: where that device
        is not the CPU; True on the CPU too, which the CPU tests take for a device's path), and
        on a CUDA rank into page-locked memory (`pin`; off only to measure what it gives)."""
        self.weight = 1.0
        self.steps = 0
        self.launched_in_backward = 0  # buckets whose allreduce overlapped backward
        self.armed = False  # hooks launch buckets only after prepare(), until reduce()
        self._hooks: list = []
        self._layouts: dict[tuple, list[_Bucket]] = {}
        """Buckets by trainable set (the parameters' ids, in order): a set trained again, as a GAN
        script's discriminator frozen for the generator's backward and thawed for its own every
        step (pix2pix's set_requires_grad), takes its buffers back instead of new ones."""
        self.returned = False
        """The last `follow` went back to a trainable set reduced before."""
        self._build()

    def _build(self) -> None:
        """The buckets for `params` (those of a set reduced before, kept), and with overlap each
        parameter's hook into its bucket."""
        for hook in self._hooks:
            hook.remove()
        key = (tuple(id(p) for p in self.params), self.sparse)
        self.returned = key in self._layouts
        if not self.returned:
            groups = _buckets(self.params[::-1], self.bucket_mb) if self.overlap else [self.params]
            if len(self._layouts) >= LAYOUTS_KEPT:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = [self._bucket(group, f"hvdhetero.grads.{i}") for i, group in enumerate(groups)]
        self.buckets = self._layouts[key]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(bucket))
                       for bucket in self.buckets if self.overlap for p in bucket.params]

    def trainable_changed(self, model: torch.nn.Module) -> bool:
        """Whether the model's trainable parameters are not the ones reduced (every step: cheap)."""
        now = [p for p in model.parameters() if p.requires_grad]
        return len(now) != len(self.params) or any(a is not b for a, b in zip(now, self.params))

    def follow(self, model: torch.nn.Module) -> list[torch.nn.Parameter] | None:
        """Where the model's trainable parameters are not those reduced so far (a frozen backbone
        unfrozen after job.prepare, as fine-tuning scripts do, a part frozen, a new head), the
        buckets are made again for them (`params` keeps its identity: clipping holds it) and the
        parameters prepare never saw are returned (each rank's own initial values: the caller
        gives every rank rank 0's); None where nothing changed. Every rank changes alike, as its
        script does; a rank that did not would send buffers of other sizes, which Horovod refuses."""
        if not self.trainable_changed(model):
            return None
        now = [p for p in model.parameters() if p.requires_grad]
        new = [p for p in now if id(p) not in self.known]
        self.known.update(id(p) for p in new)
        self.params[:] = now
        self.sparse = sparse_params(model)
        self._build()
        return new

    def _bucket(self, params, name) -> _Bucket:
        device = params[0].device if params else torch.device("cpu")
        message = torch.zeros(sum(p.numel() for p in params) + len(params), dtype=torch.float32)
        wire = None if self.wire_dtype == torch.float32 else torch.zeros_like(message, dtype=self.wire_dtype)
        stage = self.stage if self.stage is not None else device.type != "cpu"
        return _Bucket(params, message, wire, name, self.sparse, device=device if stage and params else None,
                       pin=self.pin)

    def _hook(self, bucket: _Bucket):
        def on_grad(_param):
            if not self.armed:  # an earlier micro-batch's backward: gradients still accumulate
                return
            bucket.waiting -= 1
            if bucket.waiting == 0 and bucket.handle is None:
                bucket.launch(self.weight)
                self.launched_in_backward += 1
        return on_grad

    def prepare(self, weight: float) -> None:
        """Set this rank's weight n_i / sum(n) (times what `reduce`'s `after` takes out again) for
        the coming backward (overlap mode)."""
        self.weight = weight
        self.armed = True
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)

    def reduce(self, weight: float, extras: list[float] | None = None, after: float = 1.0) -> list[float] | None:
        """Replace each .grad with sum over ranks of weight_i * grad_i, times `after` (in place,
        same device). `extras`, if given, are summed across ranks in the same round and returned.
        `after`: a factor common to every rank, applied once the sum is in (a loss scale's inverse
        kept off an fp16 wire, where the unscaled small gradients would flush to zero)."""
        self.weight = weight
        extra = None
        if extras is not None:
            extra = torch.tensor(extras, dtype=torch.float32)
            # Horovod: submitted with the gradients, so its fusion sends both in one message.
            extra_handle = hvd.allreduce_async_(extra, op=hvd.Sum, name="hvdhetero.extras")
        for bucket in self.buckets:
            if bucket.handle is None:  # not started during backward (or no overlap at all)
                bucket.launch(weight)
        for bucket in self.buckets:
            bucket.finish(after)
        self.armed = False
        self.steps += 1
        if extra is None:
            return None
        wait(extra_handle, "its gradients' reduction")
        return extra.tolist()


    def overflowed(self) -> bool:
        """Whether the last reduced gradients hold an inf or NaN. The sum carries any rank's
        overflow (IEEE addition propagates inf and NaN) and every rank holds the same bytes,
        so every rank answers alike: the loss-scaling skip needs no message of its own."""
        return any(not bool(torch.isfinite(b.buffer).all()) for b in self.buckets)

    def clipped(self, coef: float) -> None:
        """The reduced gradients were multiplied by `coef` (clipping): so are the buffers their norm comes from."""
        for bucket in self.buckets:
            bucket.buffer.mul_(coef)

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The norm of the last reduced gradients, from the CPU buffers (the same bytes on every
        rank) in float64: identical on every rank, whatever device each computes on."""
        flat = [b.buffer.to(torch.float64) for b in self.buckets]
        if norm_type == float("inf"):
            return max(float(f.abs().max()) if f.numel() else 0.0 for f in flat)
        return float(sum(float(f.abs().pow(norm_type).sum()) for f in flat) ** (1.0 / norm_type))


def sparse_params(model: torch.nn.Module) -> frozenset:
    """ids of the parameters torch gives sparse gradients: an nn.Embedding's or nn.EmbeddingBag's
    weight with sparse=True. Their reduced gradient goes back sparse on every rank, also on one
    whose share touched none of the table this step (its .grad None: it would come back dense
    there, sparse elsewhere)."""
    return frozenset(id(m.weight) for m in model.modules()
                     if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse)


@torch.no_grad()
def scale_gradients(params: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient of `params` by `factor`, in place (a loss scale's inverse, a
    clipping coefficient); nothing for 1."""
    if factor != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)


def _buckets(params: list[torch.nn.Parameter], bucket_mb: float) -> list[list[torch.nn.Parameter]]:
    limit, groups, size = bucket_mb * 2**20, [[]], 0
    for p in params:
        if groups[-1] and size + p.numel() * 4 > limit:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * 4
    return groups


def broadcast_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer] = (),
                    root_rank: int = 0) -> None:
    """Make every rank start from rank 0's parameters, buffers and optimizers' state (a GAN's
    two): job.prepare's first collective, which waits for whatever each rank's script did before
    (a download on a slow host), so its bound is the patient one."""
    what, limit = "job.prepare()'s model broadcast", patient_timeout_s()
    broadcast_tensors(list(model.state_dict().values()), root_rank, "hvdhetero.state", what, limit)
    broadcast_optimizers(optimizers, root_rank, "hvdhetero.optimizer", what, limit)


def broadcast_optimizers(optimizers: list[torch.optim.Optimizer], root_rank: int, name: str, what: str = "",
                         limit: float | None = None) -> None:
    """Each optimizer takes `root_rank`'s state (broadcast_optimizer_state): the first under
    `name`, the next ones under name.1, name.2 (a GAN's)."""
    for i, optimizer in enumerate(optimizers):
        broadcast_optimizer_state(optimizer, root_rank, name + (f".{i}" if i else ""), what, limit)


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], root_rank: int, name: str, what: str = "",
                      limit: float | None = None) -> None:
    """Every rank's `tensors` take `root_rank`'s values, in place, whatever their device: one
    Horovod broadcast of them all, as float64, so that integer buffers (BatchNorm's counters)
    and float32, bf16 and fp16 values survive exactly."""
    if not tensors:
        return
    flat = torch.cat([t.detach().cpu().to(torch.float64).reshape(-1) for t in tensors])
    broadcast_(flat, root_rank, name, what, limit)
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t).to(t.dtype))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, name: str, what: str = "",
                              limit: float | None = None) -> None:
    """Every rank takes `root_rank`'s optimizer state (a collective). The state may be empty (a
    fresh start) or hold tensors on that rank's device, which another rank may not have (cuda vs
    mps): it travels on the CPU, and load_state_dict moves it onto each rank's own parameters'
    device. The param_groups' values come too (a learning rate rank 0 loaded), but for the
    device's own switches (DEVICE_SWITCHES), which a CPU or MPS rank cannot take from a CUDA
    rank: each rank keeps its own."""
    state = to_cpu(optimizer.state_dict()) if hvd.rank() == root_rank else None
    state = broadcast_object(state, root_rank, name, what, limit)
    for theirs, mine in zip(state["param_groups"], optimizer.param_groups):
        theirs.update({k: mine[k] for k in DEVICE_SWITCHES if k in mine})
    optimizer.load_state_dict(state)


DEVICE_SWITCHES = ("fused", "capturable", "foreach", "differentiable")
"""Optimizer settings that say how a rank's device runs the update, not what it computes."""


def average_buffers(model: torch.nn.Module, more: list[torch.Tensor] = ()) -> bool:
    """Average floating-point buffers (BatchNorm running statistics) across ranks and give every
    rank rank 0's other buffers (BatchNorm's num_batches_tracked counts a rank's own forward
    passes, which differ when the shares do), so that evaluation and the checkpoint see one
    model; parameters are already identical. `more`: floating-point tensors averaged too where
    every rank has as many elements of them (an EMA's buffers: rank/averaging.py); whether it did."""
    floats = [b for b in model.buffers() if b.is_floating_point()]
    others = [b for b in model.buffers() if not b.is_floating_point()]
    agreed = not more
    if floats:
        n = float(sum(t.numel() for t in more))
        flat = torch.cat([*(b.detach().cpu().to(torch.float64).reshape(-1) for b in floats),
                          torch.tensor([n, n * n], dtype=torch.float64)])
        # Horovod: one allreduce for every buffer; the result is bit-identical on every rank.
        allreduce_(flat, hvd.Average, "hvdhetero.buffers", "averaging BatchNorm-style buffers")
        for b, chunk in zip(floats, flat[:-2].split([b.numel() for b in floats])):
            b.copy_(chunk.view_as(b).to(b.dtype))
        if flat[-1] == flat[-2] ** 2 and flat[-2] > 0:  # every rank has as many (the same bytes: decided alike)
            agreed = True
            extra = torch.cat([t.detach().cpu().to(torch.float64).reshape(-1) for t in more])
            allreduce_(extra, hvd.Average, "hvdhetero.averaged_buffers", "averaging an AveragedModel's buffers")
            for t, chunk in zip(more, extra.split([t.numel() for t in more])):
                t.detach().copy_(chunk.view_as(t).to(t.dtype))
    if others:
        flat = torch.cat([b.detach().cpu().to(torch.int64).reshape(-1) for b in others])
        broadcast_(flat, 0, "hvdhetero.int_buffers", "averaging BatchNorm-style buffers")
        for b, chunk in zip(others, flat.split([b.numel() for b in others])):
            b.copy_(chunk.view_as(b).to(b.dtype))
    return agreed


def to_cpu(obj):
    """`obj` with every tensor in it copied to the CPU (what another rank can unpickle)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
