"""policy/alone.py: a step-sync job clearly slower than its fastest rank alone is said once."""

from __future__ import annotations

from hvdhetero.policy.alone import MARGIN, MIN_OBSERVATIONS, SETTLE, AloneWatch


def watch(steps: int, step_s: float, times: list[float], sizes: list[int]) -> list:
    w = AloneWatch()
    return [v for v in (w.observe(step_s, times, sizes) for _ in range(steps)) if v is not None]


def test_a_rank_far_slower_than_the_other_is_said_once_after_the_split_settles():
    """The H200 machine's bench: the CUDA rank 29.3 ms for 254 samples, the CPU rank 143 ms for 2,
    the job's step 168 ms: at most 29.5 ms for the whole 256 alone, 0.18x."""
    said = watch(SETTLE + 40, 0.168, [0.0293, 0.1434], [254, 2])
    assert len(said) == 1, said
    v = said[0]
    assert v.fastest == 0 and abs(v.alone_s - 0.0293 * 256 / 254) < 1e-12 and v.job_s == 0.168
    assert 0.17 < v.ratio < 0.18 and v.batch == 256
    assert watch(SETTLE - 1, 0.168, [0.0293, 0.1434], [254, 2]) == [], "not before the split has settled"


def test_a_pair_faster_than_either_rank_alone_is_not_said():
    """Two equal ranks, each 16 ms for its 32 samples, the job 24 ms a step: one alone would take
    up to 32 ms for the 64."""
    assert watch(SETTLE + 40, 0.024, [0.016, 0.0165], [32, 32]) == []


def test_the_bound_is_the_ranks_own_step_scaled_up_not_a_fitted_model():
    """A rank's fixed costs do not grow with the batch, so t * B / n bounds it alone from above:
    a job just under MARGIN of that bound is said, one just over it is not."""
    bound = 0.020 * 64 / 58
    assert watch(SETTLE, bound / (MARGIN * 0.99), [0.020, 0.019], [58, 6])[0].fastest == 0
    assert watch(SETTLE, bound / (MARGIN * 1.01), [0.020, 0.019], [58, 6]) == []


def test_a_rank_without_samples_is_left_out_of_the_bound():
    """A rank given no samples this step (its time tells nothing of its speed) is not the
    fastest alone, and nothing divides by its zero."""
    said = watch(SETTLE, 0.1, [0.02, 0.0], [64, 0])
    assert len(said) == 1 and said[0].fastest == 0 and said[0].alone_s == 0.02, said
    assert watch(SETTLE + 5, 0.5, [0.0, 0.0], [0, 64]) == []


def test_the_line_names_the_rank_waited_for_and_the_ways_out_that_fit_the_options():
    """The rank waited for is another than the fast one, even where the balancer made their
    times alike; --equal-split is named only where it is set, DiLoCo not under --sync auto; ranks
    of one host (the default `local`'s two) are told to run one rank there, not to leave it out."""
    v = watch(SETTLE, 0.05, [0.030, 0.029], [60, 4])[0]
    assert v.fastest == 0 and v.waited_for([0.030, 0.029]) == 1
    plain = v.line(61, ["pc", "mac"], [0.030, 0.029], [60, 4], equal_split=False, auto=False)
    assert "waits for rank 1 (mac), 29 ms for its 4 samples" in plain and "--sync diloco:32" in plain
    assert "--equal-split" not in plain
    forced = v.line(61, ["pc", "mac"], [0.030, 0.029], [60, 4], equal_split=True, auto=True)
    assert "Train without --equal-split, or without the slower ranks" in forced and "diloco" not in forced
    shared = v.line(61, ["local", "local"], [0.030, 0.029], [60, 4], equal_split=False, auto=True)
    assert "Train with one rank on local (`slots: 1` for it in the inventory: its ranks share its cores" in shared
    tiny = v.line(61, ["pc", "mac"], [0.0004, 0.00031], [60, 4], equal_split=False, auto=True)
    assert "waits for rank 1 (mac), 0.31 ms for its 4 samples" in tiny, tiny  # it read "0 ms"
    assert "--hosts" not in shared  # one host: leaving one out leaves nothing


def test_a_diloco_round_counts_its_steps_and_names_by_speed_as_a_way_out():
    """The H200 machine's DiLoCo bench (H=32): the CUDA rank 17.5 ms a step for 254 samples, the
    CPU rank 38 ms for 2, rank 0's rounds 38 ms a step: said at the third round (past SETTLE's 60
    global steps at the second, but a verdict takes three rounds: the first runs the calibration's
    split), once; under --inner-steps same the line names by-speed, under by-speed (or --sync auto,
    which picks it) it does not, and it names no exchange every H steps."""
    w = AloneWatch()
    for _ in range(MIN_OBSERVATIONS - 1):
        assert w.observe(0.038, [0.0175, 0.038], [254, 2], steps=32) is None
    v = w.observe(0.038, [0.0175, 0.038], [254.0, 2.0], steps=32)
    assert v is not None and v.fastest == 0 and 0.45 < v.ratio < 0.47, v
    assert w.observe(0.038, [0.0175, 0.038], [254, 2], steps=32) is None, "said once"
    same = v.line(64, ["pc", "pc"], [0.0175, 0.038], [254.0, 2.0], equal_split=False, auto=False, inner="same")
    assert "Each round's steps wait for rank 1 (pc), 38 ms a step for its 2 samples, and for the exchange." in same, same
    assert "--inner-steps by-speed" in same and "--sync diloco" not in same, same
    for inner, auto in (("by-speed", False), ("same", True)):
        said = v.line(64, ["pc", "pc"], [0.0175, 0.038], [254, 2], equal_split=False, auto=auto, inner=inner)
        assert "--inner-steps" not in said and "--sync diloco" not in said, said
    mean = v.line(64, ["pc", "pc"], [0.0175, 0.038], [253.6, 2.4], equal_split=False, auto=False, inner="same")
    assert "for its 2.4 samples" in mean, mean  # a round's mean share, not rounded to 2


def test_one_round_however_long_is_not_a_verdict():
    """diloco:64 reaches SETTLE's 60 global steps in its first round, which runs the calibration's
    split (an equal one where a probe failed): no verdict from it, nor from two."""
    w = AloneWatch()
    assert [w.observe(0.2, [0.0175, 0.2], [128, 128], steps=64) for _ in range(2)] == [None, None]
