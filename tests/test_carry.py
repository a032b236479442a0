"""job.carry (hvdhetero/rank/carry.py): an LSTM's hidden state carried from window to window of a
batch function's [sequence, batch] steps (word_language_model's truncated backpropagation through
time) follows each column wherever the balancer's splits and micro-batches put it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank.carry import Carried

B = 20  # the global batch: 20 columns


def chunk(step: int, first: int, n: int, steps: int = 1):
    """The loader's chunk of rows first..first+n-1 of `step` (a batch function's rows: step * B + column)."""
    return SimpleNamespace(step=step, steps=steps, indices=tuple(range(step * B + first, step * B + first + n)))


def computed(rows, step):
    """What the model returned for `rows` at `step`: (h, c) of [layers, rows, hidden], each
    column's value saying which column and step it was computed for."""
    h = torch.tensor([100.0 * step + r for r in rows]).view(1, -1, 1).expand(2, -1, 3).clone()
    return h, -h


def columns(state):
    return [int(v) for v in state[0][0, :, 0]]


def test_each_column_gets_its_own_state_from_the_step_before_through_splits_and_micro_batches():
    carry = Carried(B)
    got = carry(tuple(torch.zeros(2, B, 3) for _ in range(2)), chunk(0, 10, 10))  # init_hidden(batch_size): all rows
    assert columns(got) == [0] * 10  # rank 1's columns 10..19, from the loop's zeros
    got = carry(computed(range(10, 20), 0), chunk(1, 10, 10))
    assert columns(got) == [10 + r for r in range(10)]  # step 0's states of columns 10..19
    # a new split, [8, 12]: this rank now has columns 8..19; 8 and 9 were rank 0's, whose states stay there
    got = carry(computed(range(10, 20), 1), chunk(2, 8, 12))
    assert columns(got) == [0, 0] + [100 + r for r in range(10, 20)]
    assert torch.equal(got[1], -got[0])  # (c follows h)
    # micro-batches of 6: each chunk gets its columns' states from the step before, not the chunk before
    got = carry(computed(range(8, 20), 2), chunk(3, 8, 6))
    assert columns(got) == [200 + r for r in range(8, 14)]
    got = carry(computed(range(8, 14), 3), chunk(3, 14, 6))
    assert columns(got) == [200 + r for r in range(14, 20)]
    got = carry(computed(range(14, 20), 3), chunk(4, 8, 6))
    assert columns(got) == [300 + r for r in range(8, 14)]
    # a column that left and comes back later starts afresh: its kept state is steps old
    got = carry(computed(range(8, 14), 4), chunk(4, 14, 6))
    got = carry(computed(range(14, 20), 4), chunk(5, 15, 5))  # a split [15, 5]
    got = carry(computed(range(15, 20), 5), chunk(6, 8, 12))  # and back to [8, 12]
    assert columns(got) == [0] * 7 + [500 + r for r in range(15, 20)]
    assert got[0].requires_grad is False


def test_a_state_of_the_wrong_width_or_a_merged_step_is_refused_saying_what_to_pass():
    carry = Carried(B)
    carry(computed(range(10, 20), 0), chunk(0, 10, 10))
    with pytest.raises(ConfigError, match=r"holds 7 rows along dimension 1, where the rows handed out last were 10 "
                                          r"and the global batch is 20"):
        carry(computed(range(7), 0), chunk(1, 10, 10))
    with pytest.raises(ConfigError, match=r"merges several steps \(--inner-steps by-speed\).*--inner-steps same"):
        carry(computed(range(10, 20), 0), chunk(1, 10, 20, steps=2))
    with pytest.raises(ConfigError, match=r"each with its rows along dimension 1"):
        carry(torch.zeros(5), chunk(1, 10, 10))
    this = chunk(1, 10, 10)
    carry(computed(range(10, 20), 0), this)
    with pytest.raises(ConfigError, match=r"twice for one batch: .* carry several as one tuple"):
        carry(computed(range(10, 20), 1), this)
