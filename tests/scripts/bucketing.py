"""A seq2seq's bucket sampler as people write one, beside the scripts that use it (buckets.py) and
for tests/test_own_sampler.py, which draws what it draws: indices shuffled with Python's random,
sorted by length within chunks of 4 batches, cut into batches (a chunk's last one shorter), the
batches shuffled."""

import random


class Buckets:
    def __init__(self, lengths, batch_size):
        self.lengths, self.batch_size = lengths, batch_size

    def __iter__(self):
        idx = list(range(len(self.lengths)))
        random.shuffle(idx)
        batches = []
        for i in range(0, len(idx), 4 * self.batch_size):
            part = sorted(idx[i:i + 4 * self.batch_size], key=lambda j: self.lengths[j])
            batches += [part[b:b + self.batch_size] for b in range(0, len(part), self.batch_size)]
        random.shuffle(batches)
        return iter(batches)

    def __len__(self):
        return -(-len(self.lengths) // self.batch_size)
