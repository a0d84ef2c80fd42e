"""Greedy block-verify speculative decoding: lossless against plain greedy, and its accounting."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_mp.export import export_drafter, load_exported
from dflash_mp.model import DFlashDrafter, DrafterArgs, build_block_attention
from dflash_mp.speculative import (
    Drafter,
    check_lossless,
    draft_block,
    inference_attention,
    first_difference,
    greedy_generate,
    speculative_generate,
)

V, H, LAYERS = 96, 64, 4


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=False)
    # float64: a near-tie between two logits cannot flip between a block and a one-token forward.
    return AutoModelForCausalLM.from_config(cfg).double().eval()


def make_drafter(target, block_size: int, seed: int = 1) -> Drafter:
    args = DrafterArgs(hidden_size=H, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=V, target_layer_ids=[0, 2], mask_token_id=V - 1, block_size=block_size,
                       rope_theta=10000.0)
    torch.manual_seed(seed)
    return Drafter.for_target(DFlashDrafter(args), args, target)


@pytest.mark.parametrize("block_size", [4, 8])
def test_random_drafter_output_equals_greedy(target, block_size):
    drafter = make_drafter(target, block_size)
    g = torch.Generator().manual_seed(block_size)
    for i in range(2):
        prompt = torch.randint(0, V - 1, (3 + 6 * i,), generator=g).tolist()
        spec = speculative_generate(target, drafter, prompt, 16)
        greedy = greedy_generate(target, prompt, 16)
        check_lossless(i, spec, greedy)
        assert len(spec.tokens) == 16
        # Accounting: one prefill plus one verify forward per step; every step yields >= 1 token.
        assert spec.num_target_forwards == 1 + len(spec.acceptance_lengths)
        assert 1 + sum(spec.acceptance_lengths) == len(spec.tokens)
        assert all(1 <= n <= block_size for n in spec.acceptance_lengths)


def test_every_proposal_accepted_when_target_and_drafter_agree(target):
    # A zero LM head makes every logit 0: the target's argmax and the drafter's are both token 0
    # everywhere, so every step must accept all B-1 proposals plus the bonus token.
    import copy

    t = copy.deepcopy(target)
    with torch.no_grad():
        t.lm_head.weight.zero_()
    drafter = make_drafter(t, 4)
    spec = speculative_generate(t, drafter, [5, 6, 7], 20)
    assert spec.tokens == [0] * 20
    # 1 token from the prefill, then 19 = 4 full blocks of 4 + one block clipped to 3.
    assert spec.acceptance_lengths == [4] * 4 + [3]
    assert spec.num_target_forwards == 6
    assert spec.tau == pytest.approx(19 / 5)
    check_lossless(0, spec, greedy_generate(t, [5, 6, 7], 20))
    # A stop token ends generation right after it, inside a block.
    stopped = speculative_generate(t, drafter, [5, 6, 7], 40, stop_ids={0})
    assert stopped.tokens == [0] and stopped.num_target_forwards == 1 and stopped.acceptance_lengths == []


def test_stop_token_and_length_limit_match_greedy(target):
    drafter = make_drafter(target, 8)
    prompt = [3, 14, 15, 92, 65]
    full = greedy_generate(target, prompt, 16).tokens
    stop = full[7]
    spec = speculative_generate(target, drafter, prompt, 16, stop_ids={stop})
    greedy = greedy_generate(target, prompt, 16, stop_ids={stop})
    check_lossless(0, spec, greedy)
    assert spec.tokens[-1] == stop and stop not in spec.tokens[:-1]
    assert len(speculative_generate(target, drafter, prompt, 1).tokens) == 1


def test_drafter_sees_context_before_the_anchor_only(target):
    # The hidden state at the anchor does not exist at inference: the row draft_block appends for
    # it must be invisible, while every earlier row matters.
    drafter = make_drafter(target, 4)
    torch.manual_seed(3)
    ctx = torch.randn(6, 2 * H, dtype=torch.float64)
    block = drafter.embed[torch.tensor([7] + [V - 1] * 3)]
    attn = drafter.model.build_attention(torch.tensor([6]), torch.tensor([True]), torch.zeros(7, dtype=torch.long))

    def hidden(anchor_row):
        return drafter.model(torch.cat([ctx, anchor_row]), block, torch.arange(7), torch.arange(6, 10), attn)

    base = hidden(ctx.new_zeros(1, 2 * H))
    assert torch.equal(hidden(torch.randn(1, 2 * H, dtype=torch.float64)), base)
    ctx[2] += 1.0
    assert not torch.allclose(hidden(ctx.new_zeros(1, 2 * H)), base)
    assert draft_block(drafter, ctx, 7, 4).shape == (3,)


@pytest.mark.parametrize("start,block_size", [(1, 4), (9, 8)])
def test_inference_mask_is_the_training_mask(start, block_size):
    args = DrafterArgs(hidden_size=H, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=V, target_layer_ids=[0], mask_token_id=0, block_size=block_size,
                       layer_types=["full_attention", "sliding_attention"], sliding_window=5)
    got = inference_attention(args, start, block_size, "cpu")
    want = build_block_attention(torch.tensor([start]), torch.tensor([True]), torch.zeros(start + 1, dtype=torch.long),
                                 block_size, layer_types=args.layer_types, sliding_window=5, backend="dense")
    assert torch.equal(got.full, want.full) and torch.equal(got.sliding, want.sliding)
    # Full layers: every context position before the anchor, the whole block, never the anchor's row.
    row = got.full[0, 0]
    assert row[:, :start].all() and not row[:, start].any() and row[:, start + 1:].all()


def test_lossless_check_names_prompt_and_position():
    from dflash_mp.speculative import GreedyResult, SpecResult

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2
    with pytest.raises(RuntimeError, match="prompt 4: first difference at generated position 1"):
        check_lossless(4, SpecResult([1, 9, 3], [2], 2), GreedyResult([1, 2, 3], 3))


def test_exported_drafter_round_trip_decodes_the_same(target, tmp_path):
    drafter = make_drafter(target, 4)
    export_drafter(drafter.model, drafter.args, tmp_path / "export", dtype=torch.float64)
    model, args = load_exported(tmp_path / "export")
    again = Drafter.for_target(model, args, target)
    a = speculative_generate(target, drafter, [1, 2, 3], 8)
    b = speculative_generate(target, again, [1, 2, 3], 8)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
