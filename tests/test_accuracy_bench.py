"""invoke bench --to-accuracy: what it reports from the runs' logged epochs (the real runs are in
test_multihost.py: they need two hosts)."""

from __future__ import annotations

import pytest

from conftest import VENV_BIN, run_cmd
from hvdhetero.bench.accuracy import Run, render, summarize, ways


def logs(accuracies, seconds_per_epoch, target):
    out, reached = [], False
    for epoch, acc in enumerate(accuracies):
        record = {"epoch": epoch, "test_accuracy": acc, "train_seconds": seconds_per_epoch * (epoch + 1),
                  "samples_seen": 1000 * (epoch + 1)}
        if acc >= target and not reached:
            record["seconds_to_target"] = record["train_seconds"]
            reached = True
        out.append(record)
    return out


def test_medians_over_seeds_and_accuracy_where_every_way_has_run():
    runs = [Run("a alone", 0, logs([0.9, 0.96, 0.971], 2.0, 0.97)),       # 6 s
            Run("a+b step", 0, logs([0.9, 0.972], 10.0, 0.97)),            # 20 s, stops after 2 epochs
            Run("a+b local:8", 0, logs([0.91, 0.95, 0.975], 1.8, 0.97)),    # 5.4 s
            Run("a alone", 1, logs([0.9, 0.972], 2.0, 0.97)),              # 4 s
            Run("a+b step", 1, logs([0.9, 0.973], 10.0, 0.97)),
            Run("a+b local:8", 1, logs([0.9, 0.96, 0.96], 1.8, 0.97))]      # never
    summary = summarize(runs, 0.97)
    rows = {r["way"]: r for r in summary["ways"]}
    assert summary["equal_samples_epochs"] == {0: 2, 1: 2}  # seed 0: step stopped after 2 epochs
    assert rows["a alone"]["seconds_to_target"] == pytest.approx(5.0)  # median of 6 and 4
    assert rows["a+b local:8"]["reached"] == 1 and rows["a+b local:8"]["seconds_to_target"] == pytest.approx(5.4)
    assert rows["a+b local:8"]["each_seconds_to_target"] == [5.4, None]
    assert rows["a+b step"]["vs_alone"] == pytest.approx(5.0 / 20.0)
    assert rows["a+b local:8"]["accuracy_equal_samples"] == pytest.approx((0.95 + 0.96) / 2)
    assert rows["a+b local:8"]["samples_per_s"] == pytest.approx(3000 / 5.4)
    assert rows["a+b local:8"]["each_vs_alone"] == [pytest.approx(6.0 / 5.4)]  # seed 1 never got there
    assert rows["a+b step"]["vs_alone_per_seed"] == pytest.approx((6.0 / 20 + 4.0 / 20) / 2)
    assert rows["a+b step"]["seeds_sooner"] == 0 and rows["a+b local:8"]["seeds_sooner"] == 1
    table = render(summary)
    assert "a+b local:8" in table and "1/2" in table and "0.25x" in table and "1.11x (1/2)" in table


def test_per_seed_ratios_compare_each_seed_with_itself():
    """A hard seed (a slow test split for every way) moves both medians; the per-seed ratio
    keeps each comparison within one seed: here the pair is sooner on 2 seeds of 3 although
    the medians' ratio says it is slower."""
    alone, pair = [10.0, 4.5, 5.3], [6.8, 5.8, 5.0]
    runs = [Run(way, seed, [{"epoch": 0, "test_accuracy": 0.98, "seconds_to_target": s, "train_seconds": s,
                             "samples_seen": 100}])
            for seed in range(3) for way, s in (("a alone", alone[seed]), ("a+b diloco:32", pair[seed]))]
    row = summarize(runs, 0.98)["ways"][1]
    assert row["vs_alone"] == pytest.approx(5.3 / 5.8)
    assert row["vs_alone_per_seed"] == pytest.approx(5.3 / 5.0) and row["seeds_sooner"] == 2


def test_elapsed_time_counts_what_the_evaluations_cost():
    """The pair's evaluations start with an exchange (one model on every rank), which the training
    loop's clock leaves out: here 1 s an epoch, so the pair sooner by the loop's clock is later
    by the elapsed one."""
    def run(way, per_epoch, exchange):
        out, elapsed = [], 0.0
        for epoch in range(3):
            elapsed += per_epoch + exchange
            out.append({"epoch": epoch, "test_accuracy": 0.9 + 0.04 * epoch, "train_seconds": per_epoch * (epoch + 1),
                        "elapsed_seconds": elapsed, "samples_seen": 100 * (epoch + 1)})
        out[-1].update(seconds_to_target=out[-1]["train_seconds"], elapsed_to_target=out[-1]["elapsed_seconds"])
        return Run(way, 0, out)

    rows = summarize([run("a alone", 1.5, 0.0), run("a+b diloco:64", 1.4, 1.0)], 0.98)["ways"]
    assert rows[1]["vs_alone_per_seed"] == pytest.approx(4.5 / 4.2)
    assert rows[1]["elapsed_to_target"] == pytest.approx(7.2)
    assert rows[1]["elapsed_vs_alone_per_seed"] == pytest.approx(4.5 / 7.2)
    assert "7.2 0.63x" in render(summarize([run("a alone", 1.5, 0.0), run("a+b diloco:64", 1.4, 1.0)], 0.98))


def test_ways_are_the_first_host_alone_step_and_the_mode_on_all():
    got = ways(["pc", "mac"], "diloco:32", True, 12.0)
    assert [w.label for w in got] == ["pc alone", "pc+mac step", "pc+mac diloco:32 overlapped"]
    assert got[0].hosts == ["pc"] and got[0].settings["slowdown"] == 1.0
    assert got[2].settings == {"sync": "diloco:32", "overlap_sync": True, "inner_steps": "same", "slowdown": 12.0}
    merged = ways(["pc", "mac"], "local:8", False, 12.0, "by-speed")[2]
    assert merged.label == "pc+mac local:8 by-speed" and merged.settings["inner_steps"] == "by-speed"
    with pytest.raises(ValueError, match="two or more"):
        ways(["pc"], "local:4", False, 1.0)


def test_ways_can_leave_step_sync_out():
    """Over a slow link step sync takes minutes a seed: --ways alone,mode trains the other two,
    and vs alone still compares with the host alone."""
    got = ways(["pc", "mac"], "diloco:64", True, 12.0, keep=("alone", "mode"))
    assert [w.label for w in got] == ["pc alone", "pc+mac diloco:64 overlapped"]
    runs = [Run(w.label, 0, [{"epoch": 0, "test_accuracy": 0.98, "seconds_to_target": s, "train_seconds": s,
                             "samples_seen": 100}]) for w, s in zip(got, (4.0, 3.2))]
    rows = summarize(runs, 0.97)["ways"]
    assert [r["vs_alone"] for r in rows] == [1.0, 1.25]


@pytest.mark.parametrize("args, named", [
    (["--to-accuracy", "1.5", "--sync", "local:4"], "--to-accuracy"),
    (["--to-accuracy", "0.9", "--sync", "step"], "local:H or diloco:H"),
    (["--to-accuracy", "0.9", "--sync", "local:4", "--seeds", "a,b"], "--seeds"),
    (["--to-accuracy", "0.9", "--sync", "local:4"], "two or more"),  # the default inventory: one host
    (["--to-accuracy", "0.9", "--sync", "local:4", "--ways", "alone,fast"], "--ways alone,fast"),
    (["--ways", "alone,mode"], "--ways does not apply"),
])
def test_bad_to_accuracy_options_exit_2_naming_them(args, named):
    proc = run_cmd([str(VENV_BIN / "invoke"), "bench", *args], check=False, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stdout + proc.stderr


def test_a_seed_only_the_pair_finished_counts_as_sooner():
    def run(way, seed, seconds):
        record = {"epoch": 0, "test_accuracy": 0.98 if seconds else 0.9, "train_seconds": seconds or 9.0,
                  "samples_seen": 100}
        return Run(way, seed, [{**record, "seconds_to_target": seconds} if seconds else record])

    runs = [run("a alone", 0, None), run("a+b local:8", 0, 7.0), run("a alone", 1, 4.0), run("a+b local:8", 1, 5.0)]
    row = summarize(runs, 0.98)["ways"][1]
    assert row["seeds_sooner"] == 1 and row["each_vs_alone"] == [pytest.approx(0.8)]  # ratios only where both did
    assert "0.80x (1/2)" in render(summarize(runs, 0.98))


def test_the_pair_is_also_compared_with_the_fast_host_alone_in_the_same_mode():
    """--ways alone-mode: the first host alone in --sync's mode (its own rounds and outer
    optimizer), so what the second host adds is read with the algorithm alike; per seed, both clocks."""
    got = ways(["pc", "mac"], "diloco:32", True, 12.0, "by-speed", keep=("alone-mode", "mode"))
    assert [w.label for w in got] == ["pc+mac diloco:32 overlapped by-speed", "pc alone, diloco:32 overlapped"]
    assert got[1].hosts == ["pc"] and got[1].settings == dict(sync="diloco:32", overlap_sync=True, slowdown=1.0)

    def run(way, seed, loop, elapsed):
        return Run(way, seed, [{"epoch": 0, "test_accuracy": 0.99, "train_seconds": loop, "samples_seen": 1000,
                                "seconds_to_target": loop, "elapsed_to_target": elapsed}])
    same, pair = "pc alone, diloco:32 overlapped", "pc+mac diloco:32 overlapped by-speed"
    runs = [run(same, 0, 10.0, 11.0), run(pair, 0, 8.0, 9.0), run(same, 1, 6.0, 6.5), run(pair, 1, 7.5, 8.0),
            run(same, 2, 9.0, 9.5), run(pair, 2, 8.0, 8.5)]
    summary = summarize(runs, 0.98, evaluated="global")
    row = next(r for r in summary["ways"] if r["way"] == pair)
    assert row["vs_alone_mode"]["per_seed"] == pytest.approx(9.0 / 8.0)  # median of 1.25, 0.8, 1.125
    assert row["vs_alone_mode"]["elapsed_per_seed"] == pytest.approx(9.5 / 8.5)
    assert row["vs_alone_mode"]["seeds_sooner"] == 2
    assert "vs_alone_mode" not in next(r for r in summary["ways"] if r["way"] == same)
    text = render(summary)
    assert f"{pair} against {same} (the same mode on one host), per seed: 1.12x (2/3 sooner), elapsed 1.12x" in text
    assert "scored the global model" in text


def test_each_run_reports_its_rate_and_the_first_hosts_compute_per_sample():
    """The first host's compute per sample, from the job's epoch records (the first epoch, with
    its warm-up, left out), tells a pair whose fast host ran slower than alone from one that
    lost its gain in waits or exchanges."""
    def epochs(us: list[float]) -> list[dict]:
        return [{"event": "epoch", "epoch": i, "compute_s": [u * 1000 / 1e6, 9.9], "rank_samples": [1000, 50]}
                for i, u in enumerate(us)]

    log = [{"epoch": 0, "test_accuracy": 0.99, "seconds_to_target": 2.0, "train_seconds": 2.0, "samples_seen": 500}]
    runs = [Run("a alone", 0, log, epochs([900.0, 140.0, 150.0, 160.0])),
            Run("a+b diloco:32", 0, log, epochs([900.0, 170.0, 168.0])),
            Run("a alone", 1, log, epochs([900.0, 146.0])),
            Run("a+b diloco:32", 1, log, [])]  # no epoch records: unknown, not zero
    rows = {r["way"]: r for r in summarize(runs, 0.98)["ways"]}
    assert rows["a alone"]["each_first_rank_us_per_sample"] == [150.0, 146.0]
    assert rows["a alone"]["first_rank_us_per_sample"] == pytest.approx(148.0)
    assert rows["a+b diloco:32"]["each_first_rank_us_per_sample"] == [169.0, None]
    assert rows["a+b diloco:32"]["first_rank_us_per_sample"] == pytest.approx(169.0)
    assert rows["a alone"]["each_samples_per_s"] == [250.0, 250.0]
    assert "a alone 148.0; a+b diloco:32 169.0" in render(summarize(runs, 0.98))
