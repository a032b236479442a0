"""invoke plan: the predictions from measured speeds and link, the advice, and the real job."""

from __future__ import annotations

import json
import re

import pytest

from conftest import VENV_BIN, run_cmd
from hvdhetero import metrics
from hvdhetero.policy.plan import Measured, Plan, advise, make, predict, render


def pc_and_mac(exchange_s: float, global_batch: int = 512) -> Measured:
    """A fast host 12x faster than the slow one (the 4070 Ti and the M2), no per-step overhead."""
    return Measured(hosts=["pc", "mac"], devices=["cuda", "mps"], overhead=[0.0, 0.0],
                    per_sample=[1e-4, 12e-4], global_batch=global_batch, wire_bytes=47_000_000,
                    latency_s=0.002, exchange_s=exchange_s, copy_s=0.01)


def by_label(predictions):
    return {p.label: p for p in predictions}


def test_predictions_follow_the_step_time_model():
    m = pc_and_mac(exchange_s=0.15)  # R = 0.15 / 0.0512 ~ 3
    got = by_label(predict(m))
    assert got["pc alone"].samples_per_s == pytest.approx(1e4)
    assert got["mac alone"].samples_per_s == pytest.approx(1e4 / 12)
    together = 1e4 + 1e4 / 12  # the balanced split: both finish together
    t = 512 / together
    assert got["pc+mac step"].samples_per_s == pytest.approx(512 / (t + 0.15), rel=0.01)
    assert got["pc+mac diloco:8"].samples_per_s == pytest.approx(512 / (t + (0.15 + 0.002 + 0.01) / 8), rel=0.01)
    # overlapped: the exchange hides behind the next H steps once H t > C
    assert got["pc+mac diloco:4 overlapped"].samples_per_s == pytest.approx(512 / (t + 0.012 / 4), rel=0.01)
    assert got["pc+mac diloco:4 overlapped"].staleness == 8 and got["pc+mac diloco:8"].staleness == 8


def test_an_exchange_behind_compute_costs_the_compute_it_steals():
    """The measured share of compute lost while an exchange is on the link is charged for as long
    as the exchange runs (at most the round): small H, whose rounds the exchange fills, loses most."""
    m = pc_and_mac(exchange_s=0.15)
    m.stolen = 0.12
    got = by_label(predict(m))
    t = 512 / (1e4 + 1e4 / 12)
    for h in (4, 32):
        expected = t + (0.012 + 0.12 * min(0.15, h * t)) / h
        assert got[f"pc+mac diloco:{h} overlapped"].samples_per_s == pytest.approx(512 / expected, rel=0.01)
    free = by_label(predict(pc_and_mac(exchange_s=0.15)))
    assert got["pc+mac diloco:4 overlapped"].samples_per_s < 0.97 * free["pc+mac diloco:4 overlapped"].samples_per_s
    pick, _ = advise(predict(m))
    assert pick.sync == "diloco:32" and pick.overlap, pick  # the stolen compute pushes H up


def test_an_exchange_slower_behind_compute_than_idle_is_exposed_by_what_outlasts_the_round():
    m = pc_and_mac(exchange_s=0.15)
    m.busy_exchange_s = 0.5  # the transfer's threads wait for the core that trains
    got = by_label(predict(m))
    t = 512 / (1e4 + 1e4 / 12)
    for h in (4, 16):
        expected = t + (0.012 + max(0.0, 0.5 - h * t)) / h
        assert got[f"pc+mac diloco:{h} overlapped"].samples_per_s == pytest.approx(512 / expected, rel=0.01)


def test_an_overlapped_mode_whose_exchange_fills_more_than_half_its_round_is_not_advised():
    """The 8 Mbit case: diloco:16 overlapped predicted 1.05x and measured 0.96x, its exchange
    (0.75 s idle, up to 1.8 s beside training) filling most of its 1.15 s rounds."""
    m = Measured(hosts=["h1", "h2"], devices=["cpu", "cpu"], overhead=[0.002, 0.024], per_sample=[1.5e-4, 18e-4],
                 global_batch=512, wire_bytes=600_000, latency_s=0.002, exchange_s=0.75, copy_s=0.002,
                 busy_exchange_s=0.73, stolen=0.02)
    got = by_label(predict(m))
    t = got["h1+h2 step"].step_s - 0.75
    for h in (16, 32):
        assert got[f"h1+h2 diloco:{h} overlapped"].headroom == pytest.approx(h * t / 0.75)
    assert not got["h1+h2 diloco:16 overlapped"].fits and got["h1+h2 diloco:32 overlapped"].fits
    pick, reason = advise(predict(m))
    assert pick.overlap and pick.headroom >= 2 and pick.sync in ("diloco:32", "diloco:64"), pick
    assert "diloco:16 overlapped" not in reason


def test_by_speed_is_predicted_when_a_slow_rank_pays_a_fixed_cost_every_step():
    """--inner-steps by-speed: the slow host's fixed cost per step (24 ms against 1.8 ms a sample,
    the test hosts at K=12) is paid once per merged step, so it can take more of the batch and
    the pair's step is quicker; with no fixed cost merging gains nothing and is not listed."""
    m = Measured(hosts=["h1", "h2"], devices=["cpu", "cpu"], overhead=[0.002, 0.024], per_sample=[1.5e-4, 18e-4],
                 global_batch=512, wire_bytes=600_000, latency_s=0.002, exchange_s=0.25, copy_s=0.002)
    got = by_label(predict(m))
    for h in (8, 32):
        merged, plain = got[f"h1+h2 diloco:{h} overlapped by-speed"], got[f"h1+h2 diloco:{h} overlapped"]
        assert merged.samples_per_s > 1.005 * plain.samples_per_s, (merged, plain)
        assert merged.staleness == plain.staleness and merged.inner_steps == "by-speed"
    pick, reason = advise(predict(m))
    assert pick.inner_steps == "by-speed" and pick.flags.endswith(" --inner-steps by-speed"), pick
    assert reason.startswith(f"use {pick.label}: +")
    assert not any(p.inner_steps == "by-speed" for p in predict(pc_and_mac(exchange_s=0.15)))


def test_advice_takes_the_freshest_mode_near_the_best_rate():
    predictions = predict(pc_and_mac(exchange_s=0.15))
    pick, reason = advise(predictions)
    best = max(p.samples_per_s for p in predictions)
    near = [p for p in predictions if p.samples_per_s >= 0.98 * best]
    assert pick in near and pick.staleness == min(p.staleness for p in near)
    # H=4 would hide the exchange too, but 10 ms of CPU work per exchange costs 6% at H=4
    assert pick.label == "pc+mac diloco:16 overlapped", pick
    assert pick.flags == "--hosts pc,mac --sync diloco:16 --overlap-sync"
    assert reason.startswith("use pc+mac diloco:16 overlapped: +") and "over pc alone" in reason
    # at most +8% (K=12): local SGD's loss per sample can eat that, and the advice says so
    assert "learns less per sample" in reason and "bench --to-accuracy A --hosts pc,mac --sync diloco:16 --overlap-sync`" in reason


def test_advice_for_rounds_says_how_often_an_evaluation_may_exchange():
    """job.evaluate/job.save make one model at once: one exchange each, not behind compute. The
    advice names how many steps apart they must be for that to cost less than the gain."""
    pick, reason = advise(predict(pc_and_mac(exchange_s=0.15)))
    gain = float(re.search(r": \+(\d+)% over pc alone", reason).group(1)) / 100
    assert pick.flush_s == pytest.approx(0.15 + 0.002 + 0.01)
    every = int(re.search(r"when ~([\d,]+) steps apart", reason).group(1).replace(",", ""))
    # an exchange every `every` steps costs about the gain (the gain is rounded in the text)
    assert pick.flush_s / (every * pick.step_s) == pytest.approx(gain, rel=0.2), (every, reason)
    assert "job.evaluate(..., exchange=False)" in reason  # the free way to watch a run
    slower = advise(predict(pc_and_mac(exchange_s=0.6)))
    if slower[0].sync != "step" and len(slower[0].hosts) == 2:  # a slower link: evaluate less often
        assert int(re.search(r"when ~([\d,]+) steps apart", slower[1]).group(1).replace(",", "")) > every


def test_a_large_gain_is_advised_without_the_per_sample_caution():
    m = pc_and_mac(exchange_s=0.15)
    m.per_sample = [1e-4, 1.5e-4]  # the slow host at 2/3 of the fast one: up to +67%
    pick, reason = advise(predict(m))
    assert pick.sync != "step" and len(pick.hosts) == 2, pick
    assert float(re.search(r": \+(\d+)% over pc alone", reason).group(1)) > 15, reason
    assert "learns less per sample" not in reason, reason


def test_a_link_that_costs_more_than_the_slow_host_adds_means_the_fast_host_alone():
    m = pc_and_mac(exchange_s=60.0)  # even diloco:128 overlapped exposes most of a minute a round
    pick, reason = advise(predict(m))
    assert pick.label == "pc alone" and pick.flags == "--hosts pc", pick
    assert reason.startswith("train on pc alone: the link costs more than mac adds (best with it: "), reason


def test_the_mode_the_advice_names_beside_the_fast_host_alone_is_a_row_of_the_table():
    """Two CPU ranks of one host, a GCN's 14 ms steps: the pair gains 2-3% at most, so the advice
    is one rank alone, naming the best the pair could do. It named the fastest mode outright
    (diloco:128 overlapped, +3%), which the table leaves out for a fresher one within 2%
    (diloco:32 overlapped): a mode the user could not find above it (a helper's GCN plan)."""
    m = Measured(hosts=["local", "local"], devices=["cpu", "cpu"], overhead=[0.0145, 0.0135],  # the whole graph
                 per_sample=[1e-8, 1e-8], global_batch=1208, wire_bytes=90_000, latency_s=0.0052,
                 exchange_s=0.0079, copy_s=0.0001, busy_exchange_s=0.0739)
    plan = make(m)
    named = re.search(r"\(best with it: (.*), [+-]\d+%\)", plan.reason)
    assert plan.advice.sync == "alone" and named, plan.reason
    rows = [line[:48].strip() for line in render(plan).splitlines()]
    assert named.group(1) in rows, (named.group(1), render(plan))


def test_one_host_with_two_ranks_weighs_each_rank_alone():
    m = Measured(hosts=["local", "local"], devices=["cpu", "cpu"], overhead=[0.001, 0.003], per_sample=[1e-4, 3e-4],
                 global_batch=64, wire_bytes=600_000, latency_s=0.001, exchange_s=0.002, copy_s=0.0)
    predictions = predict(m)
    labels = {p.label for p in predictions}
    assert {"local[0] alone", "local[1] alone", "local[0]+local[1] step"} <= labels
    alone = next(p for p in predictions if p.label == "local[0] alone")  # advised, the command said --hosts local,
    said = render(Plan(m, predictions, alone, "use local[0] alone"))  # which starts both ranks
    assert said.endswith("  invoke train --hosts local ...   (with `slots: 1` for local in the inventory: --hosts "
                         "alone starts every rank of it)"), said
    together = next(p for p in predictions if p.label == "local[0]+local[1] step")
    assert render(Plan(m, predictions, together, "use both")).endswith("invoke train --hosts local --sync step ...")


def test_a_job_that_cannot_run_rounds_is_planned_in_step_sync_and_the_plan_says_why():
    """Several optimizers (a GAN's): prepare refuses local/diloco, so the plan neither lists nor
    advises them, though at this link they would win."""
    m = pc_and_mac(exchange_s=0.6)
    assert advise(predict(m))[0].sync.startswith("diloco"), "the case: rounds would be advised"
    full = make(m, step_only="2 optimizers: local and diloco rounds count one optimizer's steps")
    assert {p.sync for p in full.predictions} == {"alone", "step"} and full.advice.sync in ("alone", "step")
    said = render(full).splitlines()
    assert "local/diloco: not weighed: 2 optimizers: local and diloco rounds count one optimizer's steps" in said
    assert full.to_json()["step_only"].startswith("2 optimizers"), "in `invoke plan --out`'s file"


@pytest.mark.alone
@pytest.mark.slow
def test_invoke_plan_on_two_local_ranks_prints_the_table_and_writes_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cmd([VENV_BIN / "invoke", "plan", "--slowdown", "3", "--out", out], timeout=300)
    assert "advice: " in proc.stdout and "local[0] alone" in proc.stdout, proc.stdout[-3000:]
    assert "never called job.prepare" not in proc.stdout, "the plan ends the job inside job.prepare: no misuse"
    plan = json.loads(out.read_text())
    m = plan["measured"]
    assert m["hosts"] == ["local", "local"] and m["wire_bytes"] > 500_000 and m["exchange_s"] > 0
    alone = {p["label"]: p["samples_per_s"] for p in plan["predictions"] if p["sync"] == "alone"}
    # the last rank acts 3x slower (2.5-3.5x measured alone, 6x with the machine busy)
    assert 1.8 < alone["local[0] alone"] / alone["local[1] alone"] < 10, (alone, m, proc.stdout[-3000:])
    assert plan["advice"]["flags"].startswith("--hosts local"), plan["advice"]
    assert not list(tmp_path.glob("runs*")), "a plan leaves no run directory"


@pytest.mark.slow
def test_train_sync_auto_uses_the_plan_for_these_hosts(tmp_path):
    proc = run_cmd([VENV_BIN / "invoke", "train", "--sync", "auto", "--epochs", "2", "--run-dir", tmp_path], timeout=300)
    chosen = re.search(r"^hvdhetero: --sync auto chose (\S+?)( overlapped)?( by-speed)?: predicted", proc.stdout, re.M)
    assert chosen, proc.stdout[-3000:]
    records = metrics.records(tmp_path / "metrics.jsonl")
    plan = next(r for r in records if r["event"] == "plan")
    together = {(p["sync"], p["overlap"]) for p in plan["predictions"] if len(p["ranks"]) == 2}
    assert (chosen[1], bool(chosen[2])) in together, (chosen[0], together)
    exchanges = [r for r in records if r["event"] == "exchange"]
    assert bool(exchanges) == (chosen[1] != "step"), "a local/diloco mode's rounds are in the metrics"
    assert records[-1]["test_accuracy"] > 0.5 and len(set(records[-1]["param_digests"])) == 1


def test_hosts_whose_caps_cannot_hold_the_global_batch_are_not_predicted_together():
    m = pc_and_mac(exchange_s=0.15)
    m.caps = [200, 200]  # 400 < 512: neither subset of both can run the global batch
    assert not [p for p in predict(m) if len(p.ranks) == 2]
    m.caps = [None, 16]  # the mac capped at 16 samples a step: the balanced step is the pc's 496
    step = by_label(predict(m))["pc+mac step"]
    assert step.step_s == pytest.approx(496 * 1e-4 + 0.15, rel=0.01)
