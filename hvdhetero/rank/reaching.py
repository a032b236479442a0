"""A loss that reaches none of the job's parameters, refused at job.backward: a model made or
trained after job.prepare's (knowledge distillation's student after its teacher, prepared first)
is no part of the job, so its gradients were reduced nowhere and each rank trained its own copy
on its own share, the run ending well with a different student on every rank (a helper's port:
82.1% and 83.1%, one device 95%). Checked at the first job.backward and at each job.epochs loop's
first, by walking the loss's graph to the parameters it accumulates into: a few thousand nodes
at most, once a loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hvdhetero.errors import ConfigError

NODES = 200_000
"""Graph nodes walked at most (a model far larger is taken to reach its parameters)."""


def reaches(loss: torch.Tensor, params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether the graph behind `loss` accumulates into any of `params`."""
    wanted = {id(p) for p in params}
    # Every node walked is held until the walk ends: torch before 2.14 (2.11 on the H200 machine)
    # makes a new Python object for a graph node at each next_functions and frees it with its
    # last reference, so a node dropped after its visit could hand its id() to the next one, which
    # read as seen and ended the walk at the loss's second node (every job refused).
    seen: dict[int, object] = {}
    todo = [loss.grad_fn]
    while todo and len(seen) < NODES:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf the backward adds to
        if variable is not None and id(variable) in wanted:
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return len(seen) >= NODES


def check(loss: torch.Tensor, params: list[torch.nn.Parameter], model: torch.nn.Module) -> None:
    """ConfigError where `loss` has a graph that reaches none of the job's `params`."""
    if loss.grad_fn is None or not params or reaches(loss, params):
        return
    raise ConfigError(f"job.backward(loss): the loss reaches none of the parameters of the model job.prepare took "
                      f"({type(model).__name__}): a model made or trained after it (a student after its teacher) "
                      "is not the job's, and each rank would train its own copy on its share alone. One job trains "
                      "one model (or a GAN's pair, prepared in one call): run each phase as a job of its own "
                      "(invoke train --script train.py -- --phase student), the first phase's weights saved with "
                      "job.save and loaded by the next (docs/api.md, 'Models trained one after another')")
