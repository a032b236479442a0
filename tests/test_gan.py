"""Two models, each with its optimizer, stepped in turn within each step (a GAN's loop, as
DCGAN's in pytorch/examples): job.prepare((netG, netD), (optG, optD), ...) on two real ranks
(tests/jobs/api_gan.py), against one process on the joined batch; a checkpoint holds both
optimizers and a resume goes on bit for bit. What the job refuses with them is in
test_api_errors."""

from __future__ import annotations

import pytest

from test_api import two_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gan(tmp_path_factory):
    return two_ranks("api_gan.py", "API_GAN", tmp_path_factory.mktemp("gan"))


@pytest.mark.parametrize("case", ["after-backward", "overlapped", "loss-scaled", "d-frozen"])
def test_a_gans_two_optimizers_step_like_one_process_on_the_joined_batch(gan, case):
    """Discriminator's two losses, its step, then the generator's loss (through the
    discriminator, whose gradients it adds to, or with it frozen: "d-frozen") and its step: three
    reductions a step, on two ranks with unequal shares, match one process to float32 rounding."""
    r = gan[case]
    assert r["sizes"][0] != r["sizes"][1] and sum(r["sizes"]) == 48, r  # calibrated by the loss_fn given
    assert r["rel_err"] <= 1e-5 and r["same_on_ranks"], r
    assert r["d_moved"] > 1e-3, "the discriminator trained"
    assert r["steps"] == [1, 2, 3], "one global step a batch, though two optimizers stepped in it"
    if case != "loss-scaled":  # (that case's SGD keeps no step count)
        assert r["adam_steps"] == [3.0, 3.0], "each optimizer stepped once a step"
    assert r["lr"] == [r["lr0"] * 0.5 ** 3] * 2, "each scheduler (scheduler=[...]) stepped once a step"
    if case == "d-frozen":  # D frozen for G's backward, thawed for its own, every step: G's set said once, not 5 times
        assert r["trainable_records"] == 1, r
    else:
        assert r["trainable_records"] == 0, r


def test_a_checkpoint_holds_both_optimizers_and_a_resume_goes_on_bit_for_bit(gan):
    r = gan["resume"]
    assert r["checkpoint_step"] == 2 and r["started_at"] == 2, r
    assert r["optimizers_saved"] == [4, 4], "Adam state for the generator's 4 parameters and the discriminator's 4"
    assert r["bit_exact"], "both models and both optimizers' states equal the uninterrupted run's after step 3"
