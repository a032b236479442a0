"""word_lm_single.py ported (the lines marked hh:). pytorch/examples' word-level language model:
`batchify` lays the corpus out in columns, the batch along the second dimension (an LSTM without
batch_first), and each step reads the next `bptt` rows of every column, with the hidden state
carried over from the window before. `get_batch` goes to job.prepare as a batch function with
`batch_dim=1`: each rank keeps its columns of every window, sized by speed, and of the targets
(flattened by `.view(-1)`: the same columns, row by row). `job.carry` hands each rank the hidden
state of the columns it has now, whatever the balancer's splits and micro-batches moved (a column
new to a rank starts afresh there). The update by hand becomes torch's SGD,
whose learning rate the script anneals as before. Each rank saves the best model and tests it, as
the original does on its one device, to a file of its own (two ranks on one host would write one
file at once).

    invoke train --script tests/scripts/ported/word_lm.py -- --epochs 4 --save /tmp/word_lm.pt
"""

import argparse
import itertools  # hh:
import math
import random
import time

import torch
import torch.nn as nn

import hvdhetero as hh  # hh:


def make_corpus(sentences, seed):
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my neighbour", "the old man", "her sister", "the teacher"]
    verbs = ["sees", "likes", "walks past", "waits for", "talks to", "paints"]
    objects = ["the river", "a red house", "the market", "his friend", "the garden", "an open door"]
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} ." for _ in range(sentences)]


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    def __init__(self):
        self.dictionary = Dictionary()
        self.train = self.tokenize(make_corpus(6000, seed=0))
        self.valid = self.tokenize(make_corpus(600, seed=1))
        self.test = self.tokenize(make_corpus(600, seed=2))

    def tokenize(self, lines):
        idss = []
        for line in lines:
            words = line.split() + ["<eos>"]
            idss.append(torch.tensor([self.dictionary.add_word(w) for w in words], dtype=torch.int64))
        return torch.cat(idss)


class RNNModel(nn.Module):
    """Encoder, a recurrent module, decoder."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        self.init_weights()

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


parser = argparse.ArgumentParser(description="PyTorch RNN/LSTM language model")
parser.add_argument("--emsize", type=int, default=64)
parser.add_argument("--nhid", type=int, default=64)
parser.add_argument("--nlayers", type=int, default=2)
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch_size", type=int, default=20, metavar="N")
parser.add_argument("--bptt", type=int, default=35)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--log-interval", type=int, default=50, metavar="N")
parser.add_argument("--save", type=str, default="model.pt")
args = parser.parse_args()

torch.manual_seed(args.seed)
job = hh.init()  # hh:
args.save = f"{args.save}.rank{job.rank}"  # hh: each rank saves and tests its own (two on one host: one file)
device = job.device  # hh: this rank's device (cuda, mps or cpu)

corpus = Corpus()


def batchify(data, bsz):
    # Work out how cleanly we can divide the dataset into bsz parts, trim off the rest, and lay
    # the parts out as columns: the batch is the second dimension.
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 10
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)

ntokens = len(corpus.dictionary)
model = RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device)
criterion = nn.NLLLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # hh: the update by hand, as torch's SGD


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


windows = itertools.cycle(range(0, train_data.size(0) - 1, args.bptt))  # hh: one window a step, in turn
model, optimizer, next_batch = job.prepare(model, optimizer, lambda: get_batch(train_data, next(windows)), batch_dim=1)  # hh:


def evaluate(data_source):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    total_loss = 0.
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = next_batch()  # hh: this rank's columns of window i
        # Starting each batch, we detach the hidden state from how it was previously produced.
        model.zero_grad()
        hidden = job.carry(repackage_hidden(hidden))  # hh: the state of this rank's columns, wherever they were
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        job.backward(loss)  # hh:

        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()  # hh:

        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print("| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | loss {:5.2f} | ppl {:8.2f}"
                  .format(epoch, batch, len(train_data) // args.bptt, lr, elapsed * 1000 / args.log_interval,
                          cur_loss, math.exp(cur_loss)))
            total_loss = 0
            start_time = time.time()


lr = args.lr
best_val_loss = None
for epoch in range(1, args.epochs + 1):
    epoch_start_time = time.time()
    train()
    val_loss = evaluate(val_data)
    print("-" * 89)
    print("| end of epoch {:3d} | time: {:5.2f}s | valid loss {:5.2f} | valid ppl {:8.2f}"
          .format(epoch, (time.time() - epoch_start_time), val_loss, math.exp(val_loss)))
    print("-" * 89)
    if not best_val_loss or val_loss < best_val_loss:
        with open(args.save, "wb") as f:
            torch.save(model, f)
        best_val_loss = val_loss
    else:
        lr /= 4.0
        optimizer.param_groups[0]["lr"] = lr  # hh:

with open(args.save, "rb") as f:
    model = torch.load(f, weights_only=False)
    model.rnn.flatten_parameters()

test_loss = evaluate(test_data)
print("=" * 89)
print("| End of training | test loss {:5.2f} | test ppl {:8.2f}".format(test_loss, math.exp(test_loss)))
print("=" * 89)
