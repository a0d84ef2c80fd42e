"""The learned tiny target, and the proof that a drafter trained by the real entry point learns it:
learned target -> regenerate -> torchrun train -> evaluate (live speculative decoding, lossless)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from dflash_mp.config import compose
from dflash_mp.builtin.learned import SIZES, stdlib_doc_chats, train_learned_target
from dflash_mp.builtin.names import LEARNED_TARGETS as TARGETS
from dflash_mp.builtin.proof import PROFILES, run_pipeline


def test_corpus_is_real_and_deterministic():
    chats = stdlib_doc_chats()
    assert len(chats) > 200
    assert chats == stdlib_doc_chats()
    text = json.dumps(chats)
    assert "json.dumps" in text and "Serialize" in text  # json.dumps' own docstring


@pytest.mark.parametrize("size", sorted(PROFILES))
def test_every_size_has_a_recipe_and_overrides_the_job_accepts(size):
    """The GPU profile only runs on a lent GPU: a misspelt override must fail here, not there."""
    assert size in SIZES and size in TARGETS
    prof = PROFILES[size]
    job = compose([f"target.path={TARGETS[size]}", *prof["train"]])
    assert job.drafter.block_size in (8, 16) and job.train.compile == "eager"
    compose(prof["eval"])
    with pytest.raises(ValueError, match="size"):
        train_learned_target("/nonexistent", size="huge")


def test_training_is_seeded(tmp_path):
    a = train_learned_target(str(tmp_path / "a"), num_steps=2, batch_size=2, seq_len=32, log_every=0)
    b = train_learned_target(str(tmp_path / "b"), num_steps=2, batch_size=2, seq_len=32, log_every=0)
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert AutoTokenizer.from_pretrained(a).chat_template


@pytest.mark.slow
def test_drafter_learns_the_learned_target(tmp_path_factory):
    # The learned target takes about a minute to train: reuse DFLASH_MP_CACHE when the caller set one.
    cache = os.environ.get("DFLASH_MP_CACHE") or str(tmp_path_factory.mktemp("learned-cache"))
    work = str(tmp_path_factory.mktemp("pipeline"))
    reports = run_pipeline(work, cache_dir=cache)
    trained, untrained = reports["trained"], reports["untrained"]
    # evaluate exits non-zero on any lossless failure; the reports say so too.
    assert trained["live"]["lossless"] and untrained["live"]["lossless"]
    tau, tau0 = trained["live"]["tau"], untrained["live"]["tau"]
    assert tau0 < 1.2, f"an untrained drafter should accept almost nothing, got tau {tau0:.3f}"
    assert tau >= 1.5 * tau0, f"trained tau {tau:.3f} vs untrained {tau0:.3f}"
    # tau_sim averages over the blocks greedy decoding lays along the held-out replies, which are the
    # target's greedy output: it must predict live tau. tau_sim_anchors (training's drafter/tau_sim)
    # weighs easy stretches as much as hard ones, which decoding crosses in few blocks: it overstates.
    sim, anchors = trained["sim"]["tau_sim"], trained["sim"]["tau_sim_anchors"]
    print(f"trained: tau_sim {sim:.3f}  tau_sim_anchors {anchors:.3f}  live tau {tau:.3f}; untrained: tau_sim "
          f"{untrained['sim']['tau_sim']:.3f}  tau_sim_anchors {untrained['sim']['tau_sim_anchors']:.3f}  "
          f"live tau {tau0:.3f}")
    assert abs(sim - tau) <= 0.15 * tau, f"tau_sim {sim:.3f} and live tau {tau:.3f} disagree by more than 15%"
    assert anchors >= sim, f"tau_sim_anchors {anchors:.3f} below tau_sim {sim:.3f}"
