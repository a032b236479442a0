"""A script's own gradient accumulation, reduced once per optimizer step.

nanoGPT and build-nanogpt step their optimizer every k batches (`gradient_accumulation_steps`
micro-steps) and call job.backward on each: each call reduced the whole gradient across the
link, k reductions for one update (a helper's build-nanogpt port: 4 a step), where DDP's
`no_sync` (their `require_backward_grad_sync`, inside an `if ddp:` a port leaves untaken)
reduces once. The job learns k from the script itself, as the backward calls between two
optimizer steps; from then on a step's first k-1 calls add to each rank's own gradient and the
k-th reduces the sum, overlapped with its backward as every call was. Each rank's gradient is
still weighted by its share: the reduction is linear, so sum_i w_i sum_j g_ij is what the k
reductions added up, in another order (where the split moved within the step, the pending sum
is rescaled to the new weight first). The prediction only decides when, never whether: a
script that steps sooner (an epoch's last, shorter group) has what is pending reduced as it
steps (or clips, or unscales a GradScaler), one that goes on past k reduces at each further
call, and the next step is predicted from the step just taken. Every rank runs the same loop
and so decides alike.

Step sync only (local/diloco reduce nothing a step), one optimizer (a GAN's each steps on what
was reduced before it), and not after a second job.backward within one batch (two losses in
turn): there every call reduces, as before.

    deferral = Deferral(eligible=kind == "step" and one_optimizer and size > 1)
    factor = deferral.rescale(weight)         # a batch's first chunk: the pending sum to its weight first
    defer = deferral.call()                   # its last chunk: add only?
    deferral.deferred(weight, seconds)        # it added only
    calls, seconds = deferral.reduced()       # it (or a flush) reduced: the calls and compute it covers
    deferral.updated()                        # the optimizer stepped: k is this step's calls
"""

from __future__ import annotations


class Deferral:
    """When a batch's job.backward adds to the rank's own gradient only (the module's docstring)."""

    def __init__(self, eligible: bool):
        self.eligible = eligible
        self.k: int | None = None
        """Calls a step, as the last step had them (None before the first step: each call reduces)."""
        self.calls = 0
        """This step's calls so far."""
        self.weight: float | None = None
        """The share weight the pending gradient carries (None: nothing pending)."""
        self.pending_calls, self.seconds = 0, 0.0
        """The calls pending and their compute seconds (the reduction carries them all)."""

    @property
    def pending(self) -> bool:
        return self.weight is not None

    def rescale(self, weight: float) -> float:
        """A batch's first job.backward (its first chunk's) is next, its rank weight `weight`: the
        factor the pending gradient is multiplied by first, so that it carries this weight (1.0:
        none). Before the chunk adds anything: a later chunk's would scale the earlier ones too."""
        if self.weight is None or self.weight == weight or weight <= 0:
            return 1.0
        factor, self.weight = self.weight / weight, weight
        return factor

    def call(self) -> bool:
        """A batch's last job.backward (its last chunk's) is next: whether it adds only. Decided on
        what every rank counts alike (the script's loop), never on a rank's own numbers."""
        self.calls += 1
        return self.eligible and self.k is not None and self.calls < self.k

    def deferred(self, weight: float, seconds: float) -> None:
        self.weight = weight
        self.pending_calls += 1
        self.seconds += seconds

    def reduced(self) -> tuple[int, float]:
        """Everything pending went into a reduction: (the calls it covers besides the one that
        reduced, their compute seconds)."""
        out = (self.pending_calls, self.seconds)
        self.weight, self.pending_calls, self.seconds = None, 0, 0.0
        return out

    def again(self) -> None:
        """A second job.backward within one batch: every call reduces from now on."""
        self.eligible = False

    def updated(self) -> None:
        """The prepared optimizer stepped: the next step is predicted to take as many calls."""
        if self.calls:
            self.k = self.calls
        self.calls = 0
