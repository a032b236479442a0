"""What `job.prepare` refuses, each with the fix in its message. Run as a user's script run
without the launcher (a job of one rank), in a process of its own."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT, VENV_BIN, run_cmd


@pytest.fixture(scope="module")
def messages():
    proc = run_cmd([VENV_BIN / "python", ROOT / "tests" / "jobs" / "prepare_errors.py"], timeout=120)
    return json.loads(proc.stdout.split("PREPARE_ERRORS ", 1)[1])


@pytest.mark.parametrize("case, message", [
    ("dataset smaller than the global batch",
     "ConfigError: job.prepare(global_batch=101): the dataset holds only 100 samples; lower global_batch"),
    ("global batch below the ranks",
     "ConfigError: job.prepare(global_batch=0): must be an integer of at least the number of ranks (1)"),
    ("model on another device",
     "ConfigError: job.prepare(): the model has parameters on meta, but this rank computes on cpu: call "
     "model.to(job.device) before prepare()"),
    ("optimizer of another model",
     "ConfigError: job.prepare(): the optimizer holds 2 parameter(s) that are not the model's"),
    ("iterable dataset", "ConfigError: job.prepare(): the dataset must be map-style (__len__ and __getitem__)"),
    ("a graph in the batch function", "ConfigError: job.prepare(model, optimizer, fn): the batch function returned a "
     "torch.sparse_coo tensor of shape (10, 10) (a graph's adjacency, say), whose rows cannot be dealt to the ranks"),
    ("dataset without a global batch", "ConfigError: job.prepare(model, optimizer, dataset): pass global_batch=, "
     "the samples of one step on all ranks together (or pass your training DataLoader: its batch_size is taken)"),
    ("loader with a sampler of its own", "ConfigError: job.prepare(): the DataLoader draws its batches with a "
     "DistributedSampler of its own, which two ranks cannot share"),
    ("a second model prepared", "ConfigError: job.prepare() was already called: one prepare per job (a GAN's two "
     "models, each with its optimizer, go in one call: job.prepare((netG, netD), (optG, optD), data))"),
    ("a student trained after its teacher", "ConfigError: job.backward(loss): the loss reaches none of the parameters "
     "of the model job.prepare took (Linear): a model made or trained after it (a student after its teacher) is not "
     "the job's"),
    ("several optimizers in micro-batches", "ConfigError: --micro-batch 8 with several optimizers: a GAN's loop "
     "steps its discriminator before its generator's backward"),
    ("several optimizers in rounds", "ConfigError: --sync local:4 with several optimizers (stepped in turn, as a "
     "GAN's): local and diloco rounds count one optimizer's steps; use --sync step (the default)"),
    ("a tuple holding no model", "ConfigError: job.prepare(model, ...): expected a torch.nn.Module (or a tuple of "
     "them, a GAN's generator and discriminator), got str"),
    ("a loop fetching one batch ahead", "accepted"),
    ("a loader of its own after the prepared one's pass", "ConfigError: job.backward() of a batch that the loader "
     "job.prepare() returned did not give (its pass over the epoch had ended two steps before, or none had begun): "
     "a DataLoader of the script's own feeds the loop, so every rank would train the whole batch, sharing nothing."),
    ("epochs from a float", "ConfigError: job.epochs(n, start=0) takes whole numbers n >= 1 and start >= 0, or the "
     "loop's range, got n=10.0, start=0: pass int(...) where a config gives a float or a string"),
    ("epochs from a range of step 2", "ConfigError: job.epochs(n, start=0) takes whole numbers n >= 1 and start >= 0, "
     "or the loop's range of step 1 alone (job.epochs(range(1, epochs + 1))), got range(0, 10, 2)"),
    ("no epochs", "ConfigError: job.epochs(n, start=0) takes whole numbers n >= 1 and start >= 0, or the loop's "
     "range, got n=0, start=0"),
    ("an empty range of epochs", "ConfigError: job.epochs(n, start=0) takes whole numbers n >= 1 and start >= 0, or "
     "the loop's range, got range(1, 1), which holds no epoch"),
])
def test_prepare_refuses_with_the_fix(messages, case, message):
    assert messages[case].startswith(message), messages[case]


def test_a_failures_summary_shows_a_line_of_the_users_script_when_the_error_is_deep_in_torch():
    """BatchNorm's "Expected more than 1 value per channel" is raised four frames deep in torch:
    the summary's innermost frames alone showed no line of the script. The innermost frame of
    the user's own code comes first then."""
    import sys
    import traceback

    from hvdhetero.rank import runner

    torch_dir = [p for p in sys.path if p.endswith("site-packages")][0] + "/torch/nn/"
    deep = [traceback.FrameSummary("/home/anna/train.py", 40, "<module>", line="loss = model(x)"),
            *(traceback.FrameSummary(torch_dir + f"f{i}.py", i, f"f{i}", line="...") for i in range(5))]
    assert [f.filename for f in runner.shown(deep)] == ["/home/anna/train.py", *(torch_dir + f"f{i}.py"
                                                                                  for i in (2, 3, 4))]
    shallow = [*deep[1:3], traceback.FrameSummary("/home/anna/train.py", 7, "load", line="raise ValueError")]
    assert runner.shown(shallow) == shallow, "the script's frame is among the innermost: as they are"


def test_a_refusal_of_ours_is_shown_at_the_scripts_call_not_in_hvdhetero():
    """job.prepare's refusal of an IterableDataset listed four frames of hvdhetero's checks below
    the script's call; a library's error keeps its frames (the summary picks among them: above)."""
    import json

    from hvdhetero.rank import runner
    from hvdhetero.rank import epochs

    try:
        epochs.numbers(0, 0)  # raises ConfigError in hvdhetero/rank/epochs.py
    except Exception as err:  # noqa: BLE001
        assert [f.filename for f in runner.frames_of(err)] == [__file__]
    from hvdhetero.recipes import data
    try:
        data.load("imagenet", "unused")  # the built-in recipe is the script there: its frames stay
    except Exception as err:  # noqa: BLE001
        assert [f.filename for f in runner.frames_of(err)] == [__file__, data.__file__], runner.frames_of(err)
    try:
        json.loads("{")  # another library's error: its frames stay
    except ValueError as err:
        frames = [f.filename for f in runner.frames_of(err)]
        assert frames[0] == __file__ and frames[-1].endswith("json/decoder.py"), frames


def test_a_script_that_never_joined_the_job_is_told_so_by_rank_0_only(monkeypatch, capsys):
    """A script run with `invoke train --script` that calls neither hh.init() nor job.prepare:
    its ranks each trained alone; rank 0 says so, the others and a one-rank job say nothing, nor
    does a script asked for its --help (argparse printed it and ended before hh.init())."""
    from hvdhetero.rank import current, runner

    monkeypatch.setattr(current, "job", None)
    for rank, size in (("1", "2"), ("0", "1")):
        monkeypatch.setenv("HOROVOD_RANK", rank)
        monkeypatch.setenv("HOROVOD_SIZE", size)
        runner.never_joined_hint()
        assert capsys.readouterr().out == ""
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "3")
    runner.never_joined_hint()
    assert capsys.readouterr().out.startswith(
        "hvdhetero: the script never called hh.init() nor job.prepare(...): each of the 3 ranks ran it on its own")
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.1", "--help"])
    runner.never_joined_hint()
    assert capsys.readouterr().out == ""


def test_a_dataloader_given_to_prepare_keeps_what_its_script_set():
    """job.prepare(model, optimizer, train_loader): its dataset, batch_size as the global batch,
    shuffle, drop_last, collate_fn, num_workers, worker_init_fn, persistent_workers and
    prefetch_factor; what prepare is passed wins."""
    import torch
    from torch.utils.data import (BatchSampler, DataLoader, RandomSampler, SubsetRandomSampler, TensorDataset,
                                  WeightedRandomSampler)

    from hvdhetero.errors import ConfigError
    from hvdhetero.rank.validate import Data, data_arguments

    ds = TensorDataset(torch.randn(10, 2))

    def init(worker):
        pass

    plain = data_arguments(DataLoader(ds, batch_size=4, shuffle=True), None, None, None)
    assert plain == Data(ds, 4, None, 0, None, shuffle=True, drop_last=False)
    kept = data_arguments(DataLoader(ds, batch_size=4, drop_last=True, collate_fn=list, num_workers=2,
                                     worker_init_fn=init, persistent_workers=True, prefetch_factor=4), None, None, None)
    assert kept == Data(ds, 4, list, 2, init, shuffle=False, drop_last=True, persistent_workers=True, prefetch_factor=4)
    assert data_arguments(DataLoader(ds, batch_size=4), 8, tuple, 0) == Data(ds, 8, tuple, 0, None, shuffle=False)
    own_batches = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 3, drop_last=True))
    assert data_arguments(own_batches, None, None, None) == Data(ds, 3, None, 0, None, shuffle=True, drop_last=True)
    class Buckets:  # a seq2seq's batches of similar lengths
        def __iter__(self):
            return iter([[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]])

        def __len__(self):
            return 3

    with pytest.raises(ConfigError, match=r"the DataLoader's batch_sampler Buckets has no batch_size: pass "
                                          r"global_batch=, the samples of its usual batch"):
        data_arguments(DataLoader(ds, batch_sampler=Buckets(), collate_fn=list), None, None, None)
    buckets = data_arguments(DataLoader(ds, batch_sampler=Buckets(), collate_fn=list), 3, None, None)
    assert (buckets.global_batch, buckets.collate_fn, buckets.own.batches) == (3, list, True)  # drawn by rank 0
    with pytest.raises(ConfigError, match=r"the DataLoader has batch_size=None \(each item of its dataset is a whole "):
        data_arguments(DataLoader(ds, batch_size=None), None, None, None)
    # torch's own ways to draw an epoch otherwise are kept, as a Draw every rank makes alike
    weighted = data_arguments(DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler([1.0] * 9 + [9.0], 30)),
                              None, None, None).draw
    assert (weighted.size, weighted.replacement, weighted.sampler.weights.tolist()) == (30, True, [1.0] * 9 + [9.0])
    with pytest.raises(ConfigError, match=r"WeightedRandomSampler has replacement=False, which torch draws through a "
                                          r"random stream that differs between a Mac's and a PC's build"):
        data_arguments(DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler([1.0] * 10, 5, replacement=False)),
                       None, None, None)
    with pytest.raises(ConfigError, match=r"the DataLoader's SubsetRandomSampler draws 3 samples an epoch, fewer than "
                                          r"one global batch \(4\)"):
        data_arguments(DataLoader(ds, batch_size=4, sampler=SubsetRandomSampler([1, 3, 5])), None, None, None)
    subset = data_arguments(DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler([1, 3, 5])), None, None, None).draw
    assert (subset.size, subset.subset.tolist()) == (3, [1, 3, 5])
    drawn = data_arguments(DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, num_samples=25)), None, None, None)
    assert (drawn.draw.size, drawn.draw.replacement, drawn.shuffle) == (25, False, True)
    assert plain.draw is None


class _Node:
    """A graph node as torch before 2.14 hands them out (2.11, the H200 image's): each access to
    next_functions makes new Python objects, freed as soon as nothing holds them."""

    def __init__(self, depth, param):
        self.depth, self.param = depth, param
        if depth == 0:
            self.variable = param  # an AccumulateGrad

    @property
    def next_functions(self):
        return ((_Node(self.depth - 1, self.param), 0),) if self.depth > 0 else ()


def test_a_loss_is_seen_to_reach_its_parameters_where_torch_makes_graph_nodes_anew():
    """The walk behind 'the loss reaches none of the parameters' refused every job on torch 2.11:
    a node freed after its visit gave its id() to the next one, read as already seen."""
    import torch

    from hvdhetero.rank import reaching

    param = torch.nn.Parameter(torch.zeros(1))
    loss = type("Loss", (), {"grad_fn": _Node(40, param)})()
    assert reaching.reaches(loss, [param])
    assert not reaching.reaches(loss, [torch.nn.Parameter(torch.zeros(1))])
