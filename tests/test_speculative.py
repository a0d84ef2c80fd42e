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


class GreedyStubDrafter:
    """Proposes the target's own greedy continuation with one slot per step wrong (or none), and
    records the context rows `speculative_generate` hands the drafter at every step.

    `wrong[k]`: the 1-based proposal slot replaced by another token at step k (0 = all right), so
    step k must accept exactly `wrong[k] - 1` proposals plus the bonus token."""

    def __init__(self, greedy: list[int], prompt_len: int, block_size: int, wrong: list[int]):
        self.greedy, self.prompt_len, self.b, self.wrong = greedy, prompt_len, block_size, wrong
        self.contexts: list[torch.Tensor] = []

    def __call__(self, drafter, context, anchor_token, block_size):
        assert block_size == self.b
        step = len(self.contexts)
        self.contexts.append(context.clone())
        anchor = context.shape[0] - self.prompt_len  # generated index of the anchor token
        assert anchor_token == self.greedy[anchor]
        proposal = torch.tensor(self.greedy[anchor + 1: anchor + self.b])
        slot = self.wrong[step % len(self.wrong)]
        if slot:
            proposal[slot - 1] = (proposal[slot - 1] + 1) % (V - 1)
        return proposal


@pytest.mark.parametrize("block_size,wrong", [(4, [2, 1, 3, 0]), (8, [5, 1, 7, 0, 3])])
def test_partial_acceptance_is_exact_lossless_and_crops_the_cache(target, monkeypatch, block_size, wrong):
    """Steps that accept part of a block: the acceptance lengths are the leading matching run plus
    one, rejected positions are cropped from the target's cache (any stale row would change later
    tokens), and the output is greedy's, token for token."""
    import dflash_mp.speculative as spec

    prompt, n = [3, 14, 15, 92, 65, 35], 24
    greedy = greedy_generate(target, prompt, n + block_size).tokens  # proposals may run past n
    stub = GreedyStubDrafter(greedy, len(prompt), block_size, wrong)
    monkeypatch.setattr(spec, "draft_block", stub)
    crops = []
    real_crop = spec._crop
    monkeypatch.setattr(spec, "_crop", lambda cache, length: (crops.append(cache.get_seq_length() - length),
                                                             real_crop(cache, length)))
    out = speculative_generate(target, make_drafter(target, block_size), prompt, n)

    want, kept, made = [], [], 1
    while made < n:
        kept.append(wrong[len(kept) % len(wrong)] or block_size)  # slot s wrong: s-1 accepted + bonus
        want.append(min(kept[-1], n - made))  # the last step is clipped to n tokens
        made += want[-1]
    assert out.acceptance_lengths == want
    assert out.tokens == greedy[:n]
    check_lossless(0, out, greedy_generate(target, prompt, n))
    # Every partly accepted step dropped its rejected rows from the cache.
    assert [c for c in crops if c] == [block_size - a for a in kept if a < block_size]


def test_decode_time_context_equals_the_training_capture(target, monkeypatch):
    """The rows the drafter reads while decoding are the ones the target worker captures for
    training over the same tokens: layer i = output of decoder layer i, position for position."""
    import copy

    import dflash_mp.speculative as spec
    from dflash_mp.batch import PackedBatch
    from dflash_mp.target import TargetWorker, truncate

    block_size, prompt, n = 4, [7, 1, 8, 2, 8], 14
    greedy = greedy_generate(target, prompt, n + block_size).tokens
    stub = GreedyStubDrafter(greedy, len(prompt), block_size, [2, 0, 3])
    monkeypatch.setattr(spec, "draft_block", stub)
    drafter = make_drafter(target, block_size)
    speculative_generate(target, drafter, prompt, n)

    layer_ids = drafter.args.target_layer_ids
    model = copy.deepcopy(target)
    truncate(model, max(layer_ids))
    worker = TargetWorker(model, layer_ids, torch.device("cpu"))
    seq = torch.tensor(prompt + greedy[:n])
    t = seq.shape[0]
    ones = torch.ones(t, dtype=torch.long)
    batch = PackedBatch(seq, torch.arange(t), torch.zeros(t, dtype=torch.long), ones, 1, t)
    trained = worker.forward(batch).hidden
    assert len(stub.contexts) >= 3
    for ctx in stub.contexts:  # the prefill's rows, then each step's accepted rows appended
        torch.testing.assert_close(ctx, trained[: ctx.shape[0]], rtol=1e-9, atol=1e-9)
