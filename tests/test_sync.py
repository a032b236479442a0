"""--sync local:H and diloco:H through the public API on two real ranks with unequal shares:
exactly what one process replaying every rank's steps computes."""

from __future__ import annotations

import pytest

from conftest import VENV_BIN, run_cmd
from hvdhetero import metrics
from test_api import two_ranks

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # calibrated splits and timed rounds (a module job)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {r["sync"]: r for r in two_ranks("sync_exactness.py", "SYNC_EXACTNESS", tmp_path_factory.mktemp("sync"))}


def test_local_1_with_plain_sgd_is_step_sync(results):
    """sum_i w_i (theta - lr g_i) = theta - lr sum_i w_i g_i: one process on the joined batch."""
    for mode in ("local:1", "step"):
        r = results[mode]
        assert all(a != b for a, b in r["shares"]), r  # unequal shares: the weights matter
        assert r["param_rel_err"] <= 1e-5 and r["moved"] > 1e-3, r


@pytest.mark.parametrize("mode", ["local:3", "diloco:3"])
def test_every_h_steps_the_ranks_meet_as_the_replay_says(results, mode):
    """local: parameters averaged by samples; diloco: outer Nesterov SGD (0.7, 0.9) on the
    weighted mean change, two rounds; each rank's inner optimizer (SGD+momentum, AdamW) its own."""
    r = results[mode]
    assert r["steps"] == 6 and all(a > b for a, b in r["shares"]), r
    assert r["param_rel_err"] <= 1e-5 and r["moved"] > 1e-3, r


@pytest.mark.parametrize("mode", ["local:3 overlapped", "diloco:3 overlapped"])
def test_overlapped_exchange_lands_one_round_late(results, mode):
    """Each round's mean change is applied at the end of the next round, each rank keeping its own
    unexchanged round on top (rank/sync.py): the replay of that rule matches, the replay that
    applies it at once does not, and after 3 rounds 2 are in the global model."""
    r = results[mode]
    assert r["steps"] == 9 and r["rounds"] == 3 and r["applied"] == 2, r
    assert r["param_rel_err"] <= 1e-5 and r["moved"] > 1e-3, r
    assert r["at_once_rel_err"] > 100 * max(r["param_rel_err"], 1e-7), r
    # job.evaluate(exchange=False) scored the global model (the replay's, rounds 1-2), not this
    # rank's own, exchanged nothing, and left this rank's own model as it was
    g = r["global_eval"]
    assert abs(g["sum"] - g["replay"]) <= 1e-5 * g["scale"] and g["own_vs_replay"] > 1e-3, g
    assert g["applied"] == 2 and g["own_kept"], g
    # the flush lands round 3 (in flight) and reports what it ran: every rank's step seconds and share
    assert r["applied_after_flush"] == 3 and r["same_model"], r
    times, shares = r["flush_times"]
    assert all(t > 0 for t in times) and shares == r["shares"][-1], r


@pytest.mark.parametrize("overlap", [False, True], ids=["at-once", "overlapped"])
def test_diloco_trains_digits_and_every_round_is_in_the_metrics(tmp_path, overlap):
    run_cmd([VENV_BIN / "invoke", "train", "--epochs", "4", "--sync", "diloco:4", "--run-dir", tmp_path,
             *(["--overlap-sync"] if overlap else [])], timeout=600)
    records = metrics.records(tmp_path / "metrics.jsonl")
    exchanges = [r for r in records if r["event"] == "exchange"]
    # 23 steps an epoch: 5 rounds of 4 and the epoch's last 3, which the evaluation exchanges at
    # once; overlapped, a round that would leave fewer than 4 steps of the epoch takes them
    # (RoundClock.due): 4 rounds of 4 and one of 7.
    per_epoch = [4, 8, 12, 16, 23] if overlap else [4, 8, 12, 16, 20, 23]
    assert [e["step"] for e in exchanges] == [23 * epoch + s for epoch in range(4) for s in per_epoch]
    assert all(sum(e["split"]) == 64 and e["seconds"] > 0 for e in exchanges)
    # Overlapped, a round lands at the next one's end; the epoch's last round lands at once.
    late = [e["round"] - e["applied"] for e in exchanges]
    assert late == ([1] * 4 + [0]) * 4 if overlap else set(late) == {0}, late
    end = records[-1]
    assert end["test_accuracy"] >= 0.85 and len(set(end["param_digests"])) == 1, end  # 0.89-0.95 seen


def test_eval_global_scores_the_global_model_and_exchanges_nothing_at_an_epochs_end(tmp_path):
    """The recipe's --eval-global (job.evaluate(..., exchange=False)): no flush at an epoch's
    end (where an exact evaluation exchanges at once: the test above). At H=30 and 23-step
    epochs a round is never shorter than H: it ends at the first epoch's end 30 steps on (46),
    launched only after that epoch's collectives; the run's end flushes the rest. The first
    epochs score the global model, the last one the exact model it saves."""
    run_cmd([VENV_BIN / "invoke", "train", "--epochs", "3", "--sync", "diloco:30", "--overlap-sync",
             "--run-dir", tmp_path, "--", "--eval-global"], timeout=600)
    records = metrics.records(tmp_path / "metrics.jsonl")
    exchanges = [r for r in records if r["event"] == "exchange"]
    assert [r["step"] for r in exchanges] == [46, 69], exchanges
    assert [e["round"] - e["applied"] for e in exchanges] == [1, 0], "launched, then landed by the final flush"
    epoch_end = [i for i, r in enumerate(records) if r["event"] == "epoch"]
    assert records.index(exchanges[0]) == epoch_end[1] + 1, "after the epoch's statistics, not before"
    # what the epoch-end launch blocked rank 0 counts in the next epoch's communication time:
    # every exchange before the last epoch's record is in some epoch's comm_s (the run's final
    # flush after it in none)
    epochs = [r for r in records if r["event"] == "epoch"]
    counted = [e["seconds"] for e in exchanges if records.index(e) < epoch_end[-1]]
    assert counted and min(counted) > 0 and sum(e["comm_s"][0] for e in epochs) == pytest.approx(sum(counted), abs=3e-4)
    logs = [r for r in records if r["event"] == "log"]
    assert [r.get("evaluated") for r in logs] == ["global", "global", None], logs
    end = records[-1]
    assert end["test_accuracy"] >= 0.8 and len(set(end["param_digests"])) == 1, end
    # a target the global model reaches stops the run, and the model saved (exchanged) is scored too
    run_cmd([VENV_BIN / "invoke", "train", "--epochs", "5", "--sync", "diloco:4", "--overlap-sync",
             "--run-dir", tmp_path / "target", "--", "--eval-global", "--target-accuracy", "0.5"], timeout=600)
    records = metrics.records(tmp_path / "target" / "metrics.jsonl")
    hit = next(r for r in records if r["event"] == "log" and r.get("reached_target"))
    assert hit["evaluated"] == "global" and hit["epoch"] < 4 and hit["final_test_accuracy"] >= 0.5, hit
    assert records[-1]["final_test_accuracy"] == hit["final_test_accuracy"], records[-1]


@pytest.fixture(scope="module")
def timing(tmp_path_factory):
    return two_ranks("sync_timing.py", "SYNC_TIMING", tmp_path_factory.mktemp("timing"))


def test_an_overlapped_round_end_does_not_wait_for_a_slower_rank(timing):
    """Rank 0's rounds take 10 ms, rank 1's 0.6 s. Overlapped, rank 0 launches each round and goes
    on (the first end applies nothing); applying round r at the end of r+1 waits for rank 1 to
    finish round r, and that wait is in wait_s with the round reported late."""
    ends = timing["overlapped"]
    assert len(ends) == 3, ends
    assert ends[0]["landed"] is None and ends[0]["took"] < 0.1, ends  # launched, not waited for
    assert ends[1]["took"] > 0.3 and ends[1]["wait_s"] > 0.3 and ends[1]["link_late"], ends


def test_a_round_that_lands_at_once_waits_for_the_slower_rank_and_reports_its_round(timing):
    ends = timing["at-once"]
    assert all(e["took"] > 0.3 and e["landed"] is not None for e in ends), ends
    times, shares = ends[0]["landed"]
    assert times[1] == pytest.approx(0.3, abs=0.1) and times[0] < 0.1, times  # mean step seconds per rank
    assert shares == [16, 4], shares


def test_a_rounds_step_seconds_count_the_work_between_steps_but_not_a_pause(timing):
    """Rank 0: three steps of 5 ms compute, 0.2 s of other work after each of the first two, a
    0.5 s pause (pause_clock) before the third. The first step counts its compute (no previous
    step), the second the 0.2 s before it too, the third its compute only: mean ~0.072 s
    (compute alone: 0.005; the pause counted: ~0.24)."""
    t0, t1 = timing["clock_times"]
    assert 0.05 < t0 < 0.12, timing["clock_times"]
    assert t1 == pytest.approx((0.3 + 0.5 + 0.3) / 3, abs=0.06), timing["clock_times"]


@pytest.mark.parametrize("kind, gain", [("local", 1.0), ("diloco", 1.9)])
def test_a_rank_that_merged_steps_adds_its_steps_to_the_round(timing, kind, gain):
    """--inner-steps by-speed: rank 1 took 1 optimizer step (+0.02, as many samples as each of rank
    0's) where rank 0 took 4 (+0.01 each). Rank 0's round counts whole and rank 1's step adds to
    it: the round moves the weights 0.04 + 0.02 = 0.06. Averaged by samples (0.036), or even
    counted per global step (0.048), the slow rank's work would shrink the fast rank's round
    (diloco: the first outer Nesterov step at lr 1, momentum 0.9, moves 1.9 times the change)."""
    merged = timing[f"merged_{kind}"]
    assert merged["inner_steps"] == [4, 1] and merged["same"], merged
    assert merged["moved"] == pytest.approx(0.06 * gain, rel=1e-5), merged


def test_by_speed_a_slower_rank_takes_fewer_bigger_inner_steps(tmp_path):
    """--inner-steps by-speed: rank 1 (4x slower) merges its shares of several steps into one
    optimizer step, so in every round it steps fewer times than rank 0, while the rounds end on
    the same global steps as always (every 8, and at each epoch's end) and the ranks end on one
    model that learned."""
    run_cmd([VENV_BIN / "invoke", "train", "--epochs", "2", "--sync", "local:8", "--inner-steps", "by-speed",
             "--slowdown", "4", "--run-dir", tmp_path], timeout=600)
    records = metrics.records(tmp_path / "metrics.jsonl")
    exchanges = [r for r in records if r["event"] == "exchange"]
    assert [e["step"] for e in exchanges] == [8, 16, 23, 31, 39, 46], exchanges
    for e, steps in zip(exchanges, [8, 8, 7, 8, 8, 7]):
        fast, slow = e["inner_steps"]
        assert fast == steps and 1 <= slow <= steps / 2, e  # rank 1's share: about 1/4-1/5 of 64
        assert e["split"][0] > e["split"][1], e
    end = records[-1]
    assert end["test_accuracy"] >= 0.85 and len(set(end["param_digests"])) == 1, end


def test_inner_steps_by_speed_needs_local_or_diloco(tmp_path):
    out = run_cmd([VENV_BIN / "invoke", "train", "--inner-steps", "by-speed", "--run-dir", tmp_path / "run"],
                  check=False, timeout=60)
    assert out.returncode == 2 and "--inner-steps by-speed needs --sync local:H or diloco:H" in out.stderr, out
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_whose_rounds_carried_other_parameters_is_refused_by_name():
    """A run that unfroze its backbone mid-way checkpoints rounds that carry it; resumed by a script
    that freezes it before job.prepare (unfreezing only at epoch k, which the resume is past), the
    saved round starts do not fit: refused with what to do, not copied slot by slot (a buffer's
    start into a parameter's, or a shape error from torch)."""
    import torch

    from hvdhetero.errors import ConfigError
    from hvdhetero.rank.sync import ParameterSync

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    saved = ParameterSync(model, "diloco", 4, 64).state_dict()
    model[0].requires_grad_(False)
    with pytest.raises(ConfigError, match=r"the checkpoint's rounds carried 6 trainable parameters, this run's 4: .* "
                                          r"make the same parameters trainable before job.prepare"):
        ParameterSync(model, "diloco", 4, 64).load_state_dict(saved)
