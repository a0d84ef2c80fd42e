"""train.feature_noise: noise on the target's context features changes training steps only; evaluation
and export never see it, and the compiled step draws it without recompiling."""

import sys
from pathlib import Path

import pytest
import torch

from dflash_mp.compile_stats import counts
from dflash_mp.export import export_drafter, load_exported
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig, add_feature_noise

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import synthetic_batch  # noqa: E402

V, H, K = 256, 32, 3
ARGS = DrafterArgs(hidden_size=H, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                   vocab_size=V, target_layer_ids=[1, 2, 3], block_size=4, mask_token_id=V - 1)
BATCHES = [synthetic_batch(128, K * H, V, "cpu", torch.float32, seed=s, lo=32, hi=64) for s in range(2)]


def build(noise: str = "none", scale: float = 0.5, target_dtype=torch.float32, bf16_values=False) -> DrafterTrainer:
    """`target_dtype`: the dtype the target's embedding and head come in (a drafter rank loads them so);
    `bf16_values`: their values rounded to bf16 whatever that dtype."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(ARGS)
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(V, H, generator=g) * 0.02, torch.randn(V, H, generator=g) * 0.02
    if bf16_values:
        embed, head = embed.bfloat16(), head.bfloat16()
    embed, head = embed.to(target_dtype), head.to(target_dtype)
    dcfg = DrafterConfig(block_size=4, num_anchors=16, max_anchors_per_doc=8, gamma=4.0)
    obj = DFlashObjective(drafter, ARGS, embed, head, dcfg)
    cfg = TrainConfig(compile="eager", precision="fp32", warmup_ratio=0.0, lr=1e-2,
                      feature_noise=noise, feature_noise_scale=scale)
    return DrafterTrainer(obj, cfg, 10, None, torch.device("cpu"))


def losses(trainer, steps=3):
    torch.manual_seed(7)
    out = []
    for i in range(steps):
        trainer.set_lr()
        out.append(trainer.forward_backward(BATCHES[i % 2]).item())
        trainer.optimizer_step()
    return out


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_noise_is_scaled_to_each_layers_rms(kind):
    torch.manual_seed(0)
    # Three captured layers three orders of magnitude apart in scale.
    hidden = torch.randn(4096, K, H) * torch.tensor([0.01, 1.0, 10.0])[:, None]
    noisy = add_feature_noise(hidden.flatten(1), kind, 0.1, K).unflatten(1, (K, H))
    rel = ((noisy - hidden).pow(2).mean((0, 2)) / hidden.pow(2).mean((0, 2))).sqrt()
    torch.testing.assert_close(rel, torch.full((K,), 0.1), atol=0.01, rtol=0)
    assert (noisy - hidden).mean().abs() < 0.01


def test_feature_noise_changes_training_not_evaluation_or_export(tmp_path):
    clean, noisy = build(), build("gaussian")
    ref = losses(clean)
    assert losses(build()) == ref  # the comparison is deterministic
    got = losses(noisy)
    # Same anchors on the first step (drawn before the forward): only the noise differs.
    assert got[0] != ref[0] and abs(got[0] - ref[0]) < 0.5 * ref[0]
    w_clean, w_noisy = clean.master_state_dict(), noisy.master_state_dict()
    assert any(not torch.equal(w_clean[k], w_noisy[k]) for k in w_clean)
    assert losses(build("uniform")) != ref

    # Evaluation mode: the objective with noise configured computes exactly the clean loss.
    noisy.objective.eval()
    clean_eval = build()
    clean_eval.objective.drafter.load_state_dict(noisy.objective.drafter.state_dict())
    clean_eval.objective.eval()
    b = BATCHES[0]
    eval_losses = []
    for tr in (noisy, clean_eval):
        torch.manual_seed(3)
        anchor_noise = torch.rand(2, b.input_ids.shape[0])
        with torch.no_grad():
            eval_losses.append(tr.fwd(b.hidden, b.input_ids, b.position_ids, b.doc_ids, b.loss_mask, anchor_noise)[0])
    assert torch.equal(*eval_losses)

    # Export writes the trained weights; what `evaluate` and serving run (the drafter itself, no
    # objective) carries no noise: the loaded export is deterministic and equals the trained drafter.
    out = export_drafter(noisy.objective.drafter, ARGS, tmp_path / "e", dtype=torch.float32,
                         state=noisy.master_state_dict())
    loaded, _ = load_exported(out)
    drafter = noisy.objective.drafter.eval()
    anchors, valid = torch.tensor([40, 90]), torch.tensor([True, True])
    attn = drafter.build_attention(anchors, valid, b.doc_ids, backend="dense")
    from dflash_mp.model import build_blocks

    block_ids, block_pos = build_blocks(b.input_ids, b.position_ids, anchors, 4, V - 1)
    emb = torch.randn(block_ids.shape + (H,))
    with torch.no_grad():
        first = loaded(b.hidden, emb, b.position_ids, block_pos, attn)
        torch.testing.assert_close(first, loaded(b.hidden, emb, b.position_ids, block_pos, attn), atol=0, rtol=0)
        torch.testing.assert_close(first, drafter(b.hidden, emb, b.position_ids, block_pos, attn), atol=0, rtol=0)


def test_noise_inside_the_compiled_step_never_recompiles():
    # aot_eager traces forward and backward as Inductor does, without its minute of C++ compile on CPU.
    tr = build("uniform")
    tr.fwd = torch.compile(tr.objective, backend="aot_eager", dynamic=False)
    ref = losses(build())
    got = losses(tr, steps=2)
    warm = counts()["graphs"]
    got += losses(tr, steps=4)
    assert counts()["graphs"] == warm
    assert got[0] != ref[0]


def test_bad_feature_noise_names_the_setting():
    with pytest.raises(ValueError, match="train.feature_noise='salt'"):
        build("salt")
    with pytest.raises(ValueError, match="feature_noise_scale=-1"):
        build("gaussian", -1.0)


def test_a_bf16_target_feeds_an_fp32_drafter():
    """Features, embedding and head arrive in the target's dtype: an fp32 drafter takes bf16 ones as
    their fp32 values (the step a bf16 target on CPU used to die in with a matmul dtype mismatch)."""
    import dataclasses

    b = BATCHES[0]
    bf16 = dataclasses.replace(b, hidden=b.hidden.bfloat16())
    got, want = [], []
    for batch, out in ((bf16, got), (dataclasses.replace(bf16, hidden=bf16.hidden.float()), want)):
        trainer = build(target_dtype=bf16.hidden.dtype if out is got else torch.float32, bf16_values=True)
        torch.manual_seed(7)
        out.append(trainer.forward_backward(batch).item())
        trainer.optimizer_step()
        out.append(trainer.master_state_dict())
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
