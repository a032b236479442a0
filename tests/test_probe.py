"""Calibration's default probe (rank/calibrate.py ProbeLoss): it calls a user's model the way
that user's training loop would, on the batch shapes people use, and finds something to
backpropagate in what the model returns; what it cannot call raises the loop's likeliest error,
and the job falls back (tests/test_ported.py trains the shapes on real ranks)."""

from __future__ import annotations

import re
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdhetero.rank import calibrate
from hvdhetero.rank.calibrate import ProbeLoss, fallback_message, output_loss, probe_error


class Counting(nn.Module):
    """A linear layer that records how it was called."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = []

    def forward(self, x):
        self.calls.append(("x", tuple(x.shape)))
        return self.linear(x)


def grads(model, loss) -> bool:
    loss.backward()
    return all(p.grad is not None for p in model.parameters())


def test_a_tensor_batch_is_the_input():
    model = Counting()
    assert grads(model, ProbeLoss()(model, torch.randn(5, 4)))
    assert model.calls == [("x", (5, 4))]


def test_a_tuple_calls_the_model_on_its_first_item():
    model = Counting()
    assert grads(model, ProbeLoss()(model, (torch.randn(5, 4), torch.randint(0, 3, (5,)))))
    assert model.calls == [("x", (5, 4))]


def test_a_namedtuple_whose_fields_forward_does_not_take_is_a_tuple():
    Batch = namedtuple("Batch", ["inputs", "targets"])
    model = Counting()
    assert grads(model, ProbeLoss()(model, Batch(torch.randn(5, 4), torch.zeros(5, dtype=torch.long))))
    assert model.calls == [("x", (5, 4))]


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class HuggingFaceStyle(nn.Module):
    """forward(input_ids, attention_mask=None, labels=None) -> an object with .loss and .logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.embed(input_ids).mean(1))
        return Output(F.cross_entropy(logits, labels) if labels is not None else None, logits)


def hf_batch(n=4):
    return {"input_ids": torch.randint(0, 10, (n, 7)), "attention_mask": torch.ones(n, 7, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,))}


def test_a_dict_whose_keys_forward_takes_is_passed_as_keywords_and_its_loss_used():
    model, batch = HuggingFaceStyle(), hf_batch()
    loss = ProbeLoss()(model, batch)
    assert torch.equal(loss, model(**batch).loss), "the model's own loss, not a stand-in"


def test_a_namedtuple_whose_fields_forward_takes_is_passed_as_keywords():
    Batch = namedtuple("Batch", ["input_ids", "labels"])
    model, batch = HuggingFaceStyle(), hf_batch()
    loss = ProbeLoss()(model, Batch(batch["input_ids"], batch["labels"]))
    assert torch.equal(loss, model(batch["input_ids"], labels=batch["labels"]).loss)


def test_a_dict_the_model_does_not_take_gives_it_the_tensor_a_loop_would():
    """{"pixels": ..., "label": ...} and forward(pixels): model(batch["pixels"]), found once and
    kept (the other ways are not tried again on every probe)."""
    model, probe = Counting(), ProbeLoss()
    batch = {"label": torch.zeros(5, dtype=torch.long), "pixels": torch.randn(5, 4)}
    assert grads(model, probe(model, batch))
    assert model.calls == [("x", (5, 4))]
    probe(model, {"label": torch.zeros(3, dtype=torch.long), "pixels": torch.randn(3, 4)})
    assert model.calls == [("x", (5, 4)), ("x", (3, 4))]


def test_a_model_that_takes_the_dict_gets_the_dict():
    class TakesDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, batch):
            return self.linear(batch["x"])

    model = TakesDict()
    assert grads(model, ProbeLoss()(model, {"x": torch.randn(5, 4), "y": torch.randn(5)}))


class Recurrent(nn.Module):
    """word_language_model's RNNModel: `forward(input, hidden)`, the batch [sequence, batch]."""

    def __init__(self):
        super().__init__()
        self.encoder, self.rnn, self.decoder = nn.Embedding(10, 4), nn.LSTM(4, 4), nn.Linear(4, 10)
        self.hidden = []

    def forward(self, input, hidden):
        self.hidden.append(hidden)
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output).view(-1, 10), hidden


def test_a_recurrent_model_without_its_hidden_state_is_called_with_none_as_an_lstm_starts_from_zeros():
    model = Recurrent()
    data = torch.randint(0, 10, (7, 3))
    assert grads(model, ProbeLoss()(model, (data, data.view(-1))))  # its (data, targets), targets flat
    assert model.hidden[-1] is None


def test_a_model_of_two_inputs_gets_all_but_the_targets():
    class Lengths(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x, lengths):
            return self.linear(x) * lengths.unsqueeze(1)

    model = Lengths()
    batch = (torch.randn(5, 4), torch.ones(5), torch.zeros(5, dtype=torch.long))
    assert grads(model, ProbeLoss()(model, batch))


def test_a_detection_model_gets_its_images_and_targets_as_the_tutorials_loop_passes_them():
    """The detection tutorial's batch, a tuple of images and a tuple of target dicts, and a
    torchvision detector, which asserts its targets in training mode (torch._assert raises an
    AssertionError, which ended the probe: the job started from an equal split). `model(images,
    targets)` returns its dict of losses."""
    import torchvision
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.rpn import AnchorGenerator

    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4, padding=1), nn.ReLU())
    backbone.out_channels = 8
    model = FasterRCNN(backbone, num_classes=2, min_size=32, max_size=32, representation_size=16,
                       rpn_anchor_generator=AnchorGenerator(sizes=((8, 16),), aspect_ratios=((1.0,),)),
                       box_roi_pool=torchvision.ops.MultiScaleRoIAlign(featmap_names=["0"], output_size=3,
                                                                       sampling_ratio=1))
    images = tuple(torch.rand(3, 32, 32) for _ in range(2))
    targets = tuple({"boxes": torch.tensor([[4.0, 4.0, 20.0, 20.0]]), "labels": torch.tensor([1])} for _ in range(2))
    model.train()
    assert grads(model, ProbeLoss()(model, (images, targets)))


@pytest.mark.parametrize("out, expected", [
    (torch.tensor([1.0, 3.0], requires_grad=True), 2.0),  # a tensor: its mean
    ((torch.tensor([1.0, 3.0], requires_grad=True), torch.tensor([4.0], requires_grad=True)), 6.0),  # a VAE's
    ({"logits": torch.tensor([2.0, 4.0], requires_grad=True), "ids": torch.tensor([7])}, 3.0),  # ints left out
    (OrderedDict(loss=None, logits=torch.tensor([5.0], requires_grad=True)), 5.0),  # ModelOutput without labels
    ({"loss": torch.tensor(0.25, requires_grad=True), "logits": torch.tensor([9.0], requires_grad=True)}, 0.25),
])
def test_what_the_model_returns_becomes_one_scalar(out, expected):
    loss = output_loss(out)
    assert loss.dim() == 0 and loss.requires_grad and loss.item() == pytest.approx(expected)


def test_an_object_with_logits_is_read_by_its_attribute():
    class Returned:
        def __init__(self, logits):
            self.logits = logits

    assert output_loss(Returned(torch.tensor([1.0, 2.0], requires_grad=True))).item() == pytest.approx(1.5)


def test_an_output_with_nothing_to_backpropagate_is_a_clear_error():
    with pytest.raises(TypeError, match=r"the model's output \(tuple\) holds no floating-point tensor that needs a "
                                        "gradient"):
        output_loss((torch.tensor([1, 2]), torch.tensor([1.0])))


def test_when_no_way_runs_the_loops_likeliest_error_is_raised():
    """A dict of tensors the model cannot take any way: the error of model(batch), the way a
    loop over dicts would call it first."""
    model = nn.Linear(4, 3)
    with pytest.raises(TypeError, match="must be Tensor, not dict"):
        ProbeLoss()(model, {"a": torch.randn(5, 2), "b": torch.randn(5, 3)})


def test_a_batch_with_its_labels_first_calls_the_model_on_the_rest():
    """torchtext's text classification tutorial: a collate_fn returns (labels, the samples' token
    ids end to end, each sample's offset in them), and the loop calls `model(text, offsets)`, an
    EmbeddingBag's input and offsets (the probe said TypeError: missing 'offsets' and the job
    started from an equal split)."""
    class TextClassification(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.fc = nn.EmbeddingBag(50, 8), nn.Linear(8, 4)

        def forward(self, text, offsets):
            return self.fc(self.embedding(text, offsets))

    model = TextClassification()
    batch = (torch.tensor([0, 3, 1]), torch.randint(0, 50, (17,)), torch.tensor([0, 5, 11]))
    assert grads(model, ProbeLoss()(model, batch))


def test_an_mlp_on_images_gets_them_flattened_as_its_loop_does():
    """Optuna's and MNIST's examples: `model(data.view(data.size(0), -1))` in the loop, a Linear
    first: called on the [N, 1, 28, 28] batch it raised "mat1 and mat2 shapes cannot be
    multiplied", and the job started from an equal split."""
    model = nn.Sequential(nn.Linear(28 * 28, 16), nn.ReLU(), nn.Linear(16, 10))
    batch = (torch.randn(6, 1, 28, 28), torch.zeros(6, dtype=torch.long))
    assert grads(model, ProbeLoss()(model, batch))


def test_a_probe_that_calls_no_way_says_the_calls_it_tried():
    """The first call's error (the loop's likeliest), named, and the others tried."""
    def forward(a, b, c, d):
        return a

    model = nn.Module()
    model.forward = forward
    with pytest.raises(TypeError) as raised:
        ProbeLoss()(model, (torch.zeros(3), torch.zeros(3), torch.zeros(3)))
    said = probe_error(raised.value)
    assert said.startswith("model(batch[0]): TypeError: ") and "missing 3 required positional arguments" in said
    assert said.endswith("; model(*batch[:-1]), model(*batch[1:]), model(*batch), model(batch[0], None, None, None) "
                         "failed too"), said


def test_the_fallback_is_said_in_one_line_naming_the_rank_and_what_helps():
    err = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail on a second line " + "x" * 300)
    line = probe_error(err)
    assert line == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    message = fallback_message(["", line], None)
    assert "\n" not in message and "(rank 1: RuntimeError: CUDA out of memory" in message
    assert message.endswith("pass job.prepare(..., loss_fn=lambda model, batch: <your loss>)")
    assert fallback_message([line, ""], lambda m, b: 0).endswith("check the loss_fn given to job.prepare")
    several = calibrate.SeveralModels(2)
    with pytest.raises(NotImplementedError) as raised:  # a GAN's two models and no loss_fn
        several(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), torch.zeros(3, 2))
    message = fallback_message([probe_error(raised.value), ""], several)
    assert ("(rank 0: NotImplementedError: job.prepare got 2 models, which no default probe calls as your step "
            "does)" in message), message
    assert message.endswith("loss_fn=lambda models, batch: <a step's losses summed>), the models in the order you "
                            "gave them")
    assert len(probe_error(ValueError("y" * 500))) <= len("ValueError: ") + 160


def test_an_error_that_is_no_wrong_call_ends_the_probe_at_once():
    """Out of memory (or a CUDA error, which may poison the device) is not a reason to call the
    model another way: the first way's error is raised and no other way runs."""
    class OutOfMemory(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)
            self.calls = 0

        def forward(self, x, lengths=None):
            self.calls += 1
            raise RuntimeError("CUDA out of memory")

    model = OutOfMemory()
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        ProbeLoss()(model, (torch.randn(5, 4), torch.ones(5), torch.zeros(5)))
    assert model.calls == 1


# -- batches of other kinds: a UserDict (transformers' BatchEncoding), a dataclass, an object with .to

class Encoding(UserDict):
    """As transformers' BatchEncoding: a UserDict (no dict subclass) read by attribute too."""

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Pair:
    pixels: torch.Tensor
    label: torch.Tensor


@dataclass
class Masked:
    x: torch.Tensor
    mask: torch.Tensor | None = field(init=False, default=None)


class Graph:
    """A batch class of the script's own that moves itself (as torch_geometric's Batch)."""

    def __init__(self, x):
        self.x = x

    def to(self, device):
        return Graph(self.x.to(device))


def test_a_userdict_or_a_dataclass_batch_is_probed_moved_and_sliced_as_a_dict():
    """A collate_fn returning a UserDict (transformers' DataCollatorWithPadding) or a dataclass
    left the probe with "a batch must hold at least one tensor (got Encoding)", and the batch on
    the CPU of an MPS or CUDA rank: moved, sliced and counted now, its type kept."""
    from hvdhetero.rank import batches

    encoding = Encoding({"input_ids": torch.zeros(6, 3, dtype=torch.long), "pixels": torch.randn(6, 4)})
    pair = Pair(torch.randn(6, 4), torch.zeros(6, dtype=torch.long))
    for batch in (encoding, pair):
        assert batches.size(batch) == 6
        moved = batches.to_device(batch, torch.device("meta"))
        assert type(moved) is type(batch) and batches.first_tensor(moved).device.type == "meta"
        part = batches.take(batch, 1, 3)
        assert type(part) is type(batch) and batches.size(part) == 2
    assert batches.to_device(encoding, torch.device("meta")).pixels.device.type == "meta"  # attribute access kept
    encoding.n_sequences = 1  # BatchEncoding's own attributes stay with a slice
    assert batches.take(encoding, 0, 2).n_sequences == 1
    masked = Masked(torch.randn(6, 4))
    masked.mask = torch.ones(6)  # a field set after construction (init=False): moved and sliced too
    assert batches.to_device(masked, torch.device("meta")).mask.device.type == "meta"
    assert batches.take(masked, 0, 2).mask.shape == (2,)
    assert batches.to_device(Graph(torch.randn(2, 4)), torch.device("meta")).x.device.type == "meta"
    assert batches.to_device(defaultdict(list, a=torch.ones(2)), torch.device("meta"))["a"].device.type == "meta"
    model = Counting()
    assert grads(model, ProbeLoss()(model, pair)) and model.calls == [("x", (6, 4))]  # model(batch.pixels)


def test_a_job_of_one_rank_is_not_probed_before_its_first_step(tmp_path):
    """Run with plain python (or as a sweep's trial on a host of one slot) a job is one rank: no
    split to size, so job.prepare calls the model no time (a 40x slow host's probes were 3.7 s
    of every such trial's start-up). `--sync auto` and `invoke plan` still time it."""
    from conftest import VENV_BIN, run_cmd

    script = tmp_path / "one_rank.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nimport hvdhetero as hh\n"
        "job = hh.init()\ncalls = []\nmodel = nn.Linear(4, 1)\n"
        "model.register_forward_pre_hook(lambda module, args: calls.append(module.training))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
        "model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16)\n"
        "print('size', job.size, 'forwards in prepare', len(calls))\n"
        "for x, y in loader:\n"
        "    optimizer.zero_grad()\n    job.backward(nn.functional.mse_loss(model(x), y))\n    optimizer.step()\n"
        "print('forwards in all', len(calls))\n")
    proc = run_cmd([VENV_BIN / "python", script], cwd=tmp_path, timeout=120)
    assert "size 1 forwards in prepare 0" in proc.stdout and "forwards in all 4" in proc.stdout, proc.stdout


def test_probes_leave_the_models_buffers_gradients_and_random_state_as_they_were():
    """A loss_fn's probes run the model in training mode: its dropout drew from torch's generator,
    which the run's first step then drew on from elsewhere (a helper's GCN port with loss_fn= no
    longer repeated its one-device run from the same seed)."""
    import numpy as np

    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 2))
    torch.manual_seed(3), np.random.seed(3)
    expected = torch.rand(5), np.random.rand()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    torch.manual_seed(3), np.random.seed(3)
    with calibrate.unchanged(model):
        for _ in range(3):
            model(torch.randn(16, 4)).sum().backward()
        np.random.rand(4)
    assert torch.equal(torch.rand(5), expected[0]) and np.random.rand() == expected[1]
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())


GRAPH_SCRIPT = """\
import torch
from torch import nn
import hvdhetero as hh

class OnGraph(nn.Module):  # pytorch/examples' GCN's shape: the graph beside the batch
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, adj):
        return self.linear(adj @ x)

job = hh.init()
x, adj, labels, idx_train = torch.randn(20, 4), torch.eye(20), torch.randint(3, (20,)), torch.arange(12)
model = OnGraph()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, rows = job.prepare(model, optimizer, lambda: idx_train)
for epoch in job.epochs(3):
    r = rows()
    job.backward(nn.functional.cross_entropy(model(x, adj)[r], labels[r]))
    optimizer.step()
    optimizer.zero_grad()
print("trained", job.step, "steps")
"""


def test_a_probe_that_cannot_call_the_model_is_not_said_where_no_split_follows(tmp_path):
    """A model taking the graph beside its batch (GCN's) cannot be probed without loss_fn. Run
    with plain python the job is one rank: no split to start from, so no line says it starts from
    an equal split (every plain run of a GCN port said so). `invoke plan` refuses, in one
    message saying to pass loss_fn, not after the line of a start it does not make."""
    from conftest import VENV_BIN, run_cmd

    script = tmp_path / "graph.py"
    script.write_text(GRAPH_SCRIPT)
    alone = run_cmd([VENV_BIN / "python", script], cwd=tmp_path, timeout=120)
    assert "trained 3 steps" in alone.stdout and "could not time" not in alone.stdout + alone.stderr, alone.stdout
    plan = run_cmd([VENV_BIN / "invoke", "plan", "--script", script], timeout=300, check=False)
    out = plan.stdout + plan.stderr
    assert plan.returncode != 0 and "invoke plan needs every rank timed on the model" in out and "loss_fn" in out, out
    assert "starting from an equal split" not in out, out


SEEDED_SCRIPT = """\
import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
torch.manual_seed(int(sys.argv[1]))  # before hh.init(), as most scripts seed
import hvdhetero as hh

job = hh.init()
model = nn.Linear(4, 1)
print("first weight", round(float(model.weight[0, 0].detach()), 6))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16)
for epoch in job.epochs(2):
    for x, y in loader:
        job.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
"""


def test_plain_python_keeps_the_scripts_seed_and_gives_each_run_a_folder_of_its_own(tmp_path):
    """Run with plain python, a script that seeds torch before hh.init() trains from its own seed
    (hh.init() seeded over it: a helper's GCN port ran as seed 0 whatever it set), and each run
    gets a new folder under ./runs, said on stderr (every plain run went to runs/latest, its
    metrics and checkpoints among the last run's: report drew two runs as one)."""
    from conftest import VENV_BIN, run_cmd

    script = tmp_path / "seeded.py"
    script.write_text(SEEDED_SCRIPT)
    torch.manual_seed(7)
    expected = round(float(nn.Linear(4, 1).weight[0, 0].detach()), 6)
    runs = [run_cmd([VENV_BIN / "python", script, "7"], cwd=tmp_path, timeout=120) for _ in range(2)]
    for proc in runs:
        assert f"first weight {expected}" in proc.stdout, (expected, proc.stdout)
    folders = [re.search(r"its run directory (\S+)", p.stderr).group(1) for p in runs]
    assert folders[0] != folders[1] and all(f.startswith("runs/") and "-seeded" in f for f in folders), folders
    for folder in folders:
        starts = [line for line in (tmp_path / folder / "metrics.jsonl").read_text().splitlines() if '"start"' in line]
        assert len(starts) == 1, folder


def test_a_compiled_model_is_told_apart_for_the_line_before_its_probes():
    """torch.compile's first calls are the probes': a user's console stayed quiet 85 s before its
    first line. rank/start.py says why first where the model is compiled (or holds a compiled part)."""
    from hvdhetero.rank.start import compiled

    model = nn.Linear(2, 2)
    assert not compiled(model) and compiled(torch.compile(model))
    assert compiled(nn.Sequential(nn.ReLU(), torch.compile(model)))
