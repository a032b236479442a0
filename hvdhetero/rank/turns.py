"""Several optimizers stepped in turn within each global step: a GAN's discriminator, then its
generator, each on gradients the step's backward passes just made.

    job.backward(errD_real); job.backward(errD_fake); optimizerD.step()    # D's turn
    job.backward(errG); optimizerG.step()                                  # G's turn

Every job.backward reduces every gradient the job holds, so in D's turn G's gradients are
reduced as they stand: last step's, which DCGAN's loop clears only before errG. Two things are
therefore decided per optimizer, from its own parameters, as torch's GradScaler decides per
optimizer:
- whether it skips (fp16 loss scaling, or a GradScaler of the script's): its own reduced
  gradients hold an inf or NaN. Decided over the whole reduction, G's stale overflow from step k
  would skip D and G again at step k+1 (and halve the scale twice); one device skips G at k only.
- whether its gradients were reduced at all: a plain `loss.backward()` before `optimizerG.step()`
  (one of a port's changed lines forgotten) leaves G's gradients each rank's own, so the ranks'
  generators would drift apart, said by no error. A hook on every parameter marks what a backward
  touched; a reduction clears the marks; an optimizer with marked parameters refuses to step.
"""

from __future__ import annotations

import torch


class InTurn:
    """The prepared job's optimizers when there are several: which parameters hold gradients no
    reduction has seen, and whether an optimizer's own reduced gradients overflowed."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], model: torch.nn.Module):
        self.optimizers = optimizers
        self.touched: set[int] = set()
        """ids of the parameters a backward added to since the last reduction."""
        self.checks = False
        """Whether the last reduction's overflow skips a step (a loss scale, the script's GradScaler)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._touch) for p in model.parameters()]

    def _touch(self, param: torch.Tensor) -> None:
        self.touched.add(id(param))

    def reduced(self, checks: bool) -> None:
        """A job.backward's reduction is in: every gradient is the ranks' sum now."""
        self.touched.clear()
        self.checks = checks

    def params(self, index: int) -> list[torch.Tensor]:
        return [p for group in self.optimizers[index].param_groups for p in group["params"]]

    def unreduced(self, index: int) -> int:
        """How many of optimizer `index`'s parameters hold a gradient no reduction has seen."""
        return sum(id(p) in self.touched for p in self.params(index))

    def overflowed(self, index: int) -> bool:
        """Whether optimizer `index`'s reduced gradients hold an inf or NaN (the same bytes on every
        rank: every rank answers alike), where the reduction's overflow skips a step."""
        if not self.checks:
            return False
        for p in self.params(index):
            grad = p.grad
            if grad is None:
                continue
            values = grad.coalesce().values() if grad.is_sparse else grad
            if not bool(torch.isfinite(values).all()):
                return True
        return False

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
