"""The Triton block-attention kernels (drafter.attention=triton) against the dense mask they replace.

The spans (which context rows each block sees, which blocks touch each key tile) are checked against
`make_mask_mod` on CPU. The kernels' output and gradients are checked against dense sdpa on the same
`mask_mod`: on CPU in Triton's interpreter (tests/triton_interp.py), on CUDA in bf16 and compiled; both
with the context tiles loaded through pointers and through tensor descriptors (TMA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

import triton_interp
from dflash_mp.model.anchors import sample_anchors
from dflash_mp.model.attention import make_mask_mod, resolve_backend
from dflash_mp.model.block_attn import block_spans, blocks_per_program, unsupported
from dflash_mp.triton_launch import use_tma

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benches' helpers

# (T, A, B, Hq, Hkv, D, window, document lengths): full and sliding; invalid anchors (fewer
# candidates than A); 3 query heads per KV head (48 rows in a 64-row tile); B = 32; one document;
# T not a multiple of the key tile; an odd number of blocks (the last pair has one).
CASES = [
    (80, 6, 16, 4, 2, 16, None, [30, 37]),
    (80, 6, 16, 4, 2, 16, 5, [30, 37]),
    (80, 5, 16, 4, 2, 16, None, [30, 37]),
    (80, 5, 16, 4, 2, 16, 5, [30, 37]),
    (100, 40, 16, 6, 2, 16, None, [3, 40, 20]),
    (100, 40, 16, 6, 2, 16, 7, [3, 40, 20]),
    (70, 4, 16, 2, 2, 32, 20, [70]),
    (130, 10, 32, 2, 1, 16, None, [130]),
]


def make_row(T, A, lens, device="cpu", seed=0):
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((T - sum(lens),), -1)])
    g = torch.Generator().manual_seed(seed)
    loss = ((torch.rand(T, generator=g) < 0.8) & (docs >= 0)).long()
    noise = torch.rand(2, T, generator=g)
    anchors, valid = sample_anchors(loss, docs, A, None, noise=noise)
    return anchors.to(device), valid.to(device), docs.to(device)


def run_kernels(T, A, B, Hq, Hkv, D, window, lens, device="cpu", dtype=torch.float32, compiled=False):
    """The kernels on a case's row with fixed random inputs: the row, the spans, q, k, v, the incoming
    gradient and `got`, the kernels' (out, dq, dk, dv)."""
    from types import SimpleNamespace

    from dflash_mp.model import block_attn
    from dflash_mp.model.block_attn import block_attention

    anchors, valid, docs = make_row(T, A, lens, device)
    Q = A * B
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, D, generator=g).to(device, dtype).requires_grad_()
               for n, h in ((Q, Hq), (T + Q, Hkv), (T + Q, Hkv)))
    assert block_attn.USE_TMA is not True or use_tma(True, k, v)  # forced: the descriptors can take these
    spans = block_spans(anchors, valid, docs, B, window)
    fn = torch.compile(block_attention, fullgraph=True) if compiled else block_attention
    out = fn(q, k, v, spans)
    grad = torch.randn(out.shape, generator=g).to(device, dtype)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
    return SimpleNamespace(anchors=anchors, valid=valid, docs=docs, spans=spans, q=q, k=k, v=v, grad=grad, got=got)


def compare(T, A, B, Hq, Hkv, D, window, lens, device="cpu", dtype=torch.float32, compiled=False):
    """The kernels' out, dq, dk, dv against fp32 dense sdpa on `make_mask_mod`: relative L2 errors."""
    return dense_errors(run_kernels(T, A, B, Hq, Hkv, D, window, lens, device, dtype, compiled), T, B, window)


def dense_errors(r, T, B, window):
    """`compare`'s errors for `run_kernels`' result `r` of a case with T, B and window."""
    anchors, valid, docs, q, k, v, grad, got = r.anchors, r.valid, r.docs, r.q, r.k, r.v, r.grad, r.got
    Q, device = q.shape[0], q.device
    mask = create_mask(make_mask_mod(anchors, valid, docs, T, B, window), 1, 1, Q, T + Q, device)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (qf, kf, vf)), attn_mask=mask,
                                         enable_gqa=True)[0].transpose(0, 1)
    want = (ref, *torch.autograd.grad(ref, (qf, kf, vf), grad.float()))
    return {name: float((a.detach().float() - b.detach()).norm() / b.detach().norm())
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def check_interpreter(blocks: int) -> None:
    """Every case in fp32 through the interpreter, `blocks` blocks per program in the forward and dQ, the
    context tiles through pointers and through descriptors (whose rows past a span's end are other
    blocks' keys, not zeros): the kernels' arithmetic is the dense path's. With one block a program,
    dK/dV walks 64-row context tiles (bench/flex_tiles.py's triton-n2x64w8), with two the default
    tiles: more tiles a row, each touched by fewer blocks (dK/dV does not depend on `blocks`)."""
    from dflash_mp.model import block_attn

    block_attn.TILES.update(q_blocks=blocks, **({"BLOCK_N2": 64} if blocks == 1 else {}))
    for tma in (False, True):
        block_attn.USE_TMA = tma
        for case in CASES:
            errors = compare(*case)
            assert max(errors.values()) < 1e-5, (tma, blocks, case, errors)


def test_spans_are_the_mask_mods_context_and_the_key_tiles_cover_exactly_the_blocks_that_see_them():
    for T, A, B, _, _, _, window, lens in CASES:
        anchors, valid, docs = make_row(T, A, lens)
        tile = 16
        spans = block_spans(anchors, valid, docs, B, window, key_tile=tile)
        seen = create_mask(make_mask_mod(anchors, valid, docs, T, B, window), 1, 1, A * B, T + A * B,
                           device="cpu")[0, 0, :, :T]
        per_block = seen.view(A, B, T).any(1)  # [A, T]: context rows some slot of block i sees
        rows = torch.arange(T)
        span = (rows >= spans.start[:, None]) & (rows < spans.end[:, None])
        # Slot 0 sees exactly the span; later slots see no more (a window cuts them inside the kernels).
        assert torch.equal(seen.view(A, B, T)[:, 0], span)
        assert not (per_block & ~span).any()
        assert (spans.start[~valid] == T).all() and (spans.end[~valid] == T).all()
        assert (spans.start.diff() >= 0).all() and (spans.end.diff() >= 0).all()
        for j in range(spans.lo.shape[0]):
            touched = span[:, j * tile:(j + 1) * tile].any(1).nonzero().flatten().tolist()
            lo, hi = int(spans.lo[j]), int(spans.hi[j])
            assert set(touched) <= set(range(lo, hi)), (j, touched, lo, hi)
            # No block in [lo, hi) is outside the tile's reach: each overlaps it or has an empty span.
            for i in range(lo, hi):
                assert i in touched or spans.start[i] == spans.end[i], (j, i)
        assert sorted(spans.order.tolist()) == list(range(A))
        lengths = spans.end - spans.start
        assert (lengths[spans.order.long()].diff() <= 0).all()  # longest span first
        pairs = [(2 * p, 2 * p + 1) for p in spans.pair_order.tolist()]
        assert sorted(i for pair in pairs for i in pair if i < A) == list(range(A))
        work = [sum(int(lengths[i]) for i in pair if i < A) for pair in pairs]
        assert work == sorted(work, reverse=True)  # most context rows first


def test_a_drafter_on_a_gpu_the_kernels_do_not_fit_runs_flex_and_says_why(monkeypatch, caplog):
    """`auto` asks the GPU for its shared memory (triton_launch.shared_memory, read from Triton): on a
    99 KiB GPU the drafter runs flex_attention and the log says why."""
    from dflash_mp.model import drafter as drafter_module
    from dflash_mp.model.drafter import DFlashDrafter
    from drafter_utils import tiny_args

    monkeypatch.setattr(drafter_module, "shared_memory", lambda device: 101376)
    with caplog.at_level("INFO"):
        backend = DFlashDrafter(tiny_args(block_size=16, head_dim=128)).attention_backend("auto", "cuda")
    assert backend == "flex"
    assert "the Triton block kernels cannot run a GPU with 99 KiB of shared memory" in caplog.text


def test_shapes_the_kernels_refuse_are_named_with_the_fix():
    assert unsupported(32, 8, 128, 16) is None  # Qwen3-8B
    assert "block_size=12" in unsupported(32, 8, 128, 12)
    assert "head_dim=96" in unsupported(32, 8, 96, 16)
    assert "256 rows" in unsupported(64, 4, 128, 16)
    # The GPU's shared memory a block (bytes): the H200 and the A100 run them; a 99 KiB GPU (L40S, A10,
    # RTX 30-50) cannot at head_dim 128 (dQ asks for 128 KiB there, bench/kernel_resources.py), and `auto`
    # runs flex on it.
    assert unsupported(32, 8, 128, 16, 232448) is None and unsupported(64, 8, 128, 16, 166912) is None
    small = unsupported(32, 8, 128, 16, 101376)
    assert "99 KiB of shared memory" in small
    assert unsupported(32, 8, 64, 16, 101376) is None  # head_dim 64 fits one (dQ 76 KiB)
    # head_dim 256 (a drafter of a Qwen3.5 target, whose head_dim it takes by default) asks for more
    # than the H200 has: refused on every GPU, so `auto` runs flex for it.
    assert all("head_dim=256" in unsupported(16, 4, 256, 16, have) for have in (None, 232448))
    with pytest.raises(ValueError, match="cannot run a GPU with 99 KiB.*drafter.attention=flex"):
        resolve_backend("triton", "cpu", small)
    with pytest.raises(ValueError, match="drafter.attention=triton cannot run block_size=12.*drafter.attention=flex"):
        resolve_backend("triton", "cpu", unsupported(32, 8, 128, 12))
    assert resolve_backend("auto", "cpu") == "dense"
    # Two blocks per program where their rows fit one tile (8B: 4 heads x 16 slots, twice), else one.
    assert blocks_per_program(2, 64) == 2 and blocks_per_program(2, 128) == 1 and blocks_per_program(1, 64) == 1
    with pytest.raises(ValueError, match="asks for 3 blocks per program; the kernels take 1 or 2"):
        blocks_per_program(3, 32)


# Documents longer than the 16-row tiles of check_whole_tiles: most context tiles are seen whole.
WHOLE_CASES = [CASES[0], CASES[4], CASES[7], (120, 12, 16, 4, 2, 16, None, [70, 45])]


def check_whole_tiles() -> None:
    """With 16-row key tiles, the forward's tiles every row of a program sees whole skipping the mask (the
    default) against every tile masked: the same outputs and gradients bit for bit (the interpreter fuses
    no multiply-add; the gradients read the forward's log-sum-exp), and those of dense attention; one and
    two blocks a program, through pointers and descriptors."""
    from dflash_mp.model import block_attn

    whole = 0
    for blocks in (1, 2):
        for tma in (False, True):
            block_attn.TILES.update(q_blocks=blocks, BLOCK_N=16, DQ_BLOCK_N=16, BLOCK_N2=16)
            block_attn.USE_TMA = tma
            for case in WHOLE_CASES:
                results = []
                for on in (True, False):
                    block_attn.WHOLE_TILES = on
                    results.append(run_kernels(*case))
                block_attn.WHOLE_TILES = True
                T, _, B, *_, window, _ = case
                errors = dense_errors(results[0], T, B, window)
                assert max(errors.values()) < 1e-5, (tma, blocks, case, errors)
                whole += whole_tiles(results[0].spans, blocks, 16)
                results = [r.got for r in results]
                for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
                    assert torch.equal(a, b), (name, tma, blocks, case)
    assert whole > 100, whole  # the cases do take the unmasked path


def whole_tiles(spans, blocks: int, tile: int) -> int:
    """The forward's whole tiles over all programs: each program's tiles inside its first block's span,
    for a pair only where the second block shares that span's start (the same document, no window)."""
    if spans.window:
        return 0
    start, end = spans.start.tolist(), spans.end.tolist()
    firsts = range(0, len(start), blocks)
    return sum((end[i] - start[i]) // tile for i in firsts
               if blocks == 1 or (i + 1 < len(start) and start[i + 1] == start[i] < end[i]))


def check_heads_first() -> None:
    """Each kernel named in block_attn.HEADS_FIRST (the default: dK/dV's) puts the KV heads on the axis
    the GPU starts fastest, so its programs start longest first over all heads; the others start head by
    head. Every choice gives the same outputs and gradients bit for bit."""
    from dflash_mp.model import block_attn
    from dflash_mp.model.block_attn import block_attention

    grids = []

    def recording(kernel, grid, *args):
        grids.append((kernel.fn.__name__, grid))
        return launch(kernel, grid, *args)

    launch, block_attn.launch = block_attn.launch, recording
    T, A, B, Hq, Hkv, D, window, lens = CASES[4]  # 3 query heads a KV head, 3 documents, 40 blocks
    anchors, valid, docs = make_row(T, A, lens)
    spans = block_spans(anchors, valid, docs, B, window)
    g = torch.Generator().manual_seed(1)
    shapes = ((A * B, Hq), (T + A * B, Hkv), (T + A * B, Hkv))
    q, k, v = (torch.randn(n, h, D, generator=g).requires_grad_() for n, h in shapes)
    grad = torch.randn(A * B, Hq, D, generator=g)
    places = dict(zip(block_attn.KERNELS, (spans.pair_order.shape[0], spans.pair_order.shape[0], spans.lo.shape[0])))
    default = block_attn.HEADS_FIRST
    assert default == {"dkv"}, default
    results = []
    # each kernel alone (a kernel reading another's choice fails here), all of them, none
    for heads_first in (default, frozenset({"fwd"}), frozenset({"dq"}), frozenset(places), frozenset()):
        block_attn.HEADS_FIRST = heads_first
        grids.clear()
        out = block_attention(q, k, v, spans)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
        want = [(f"block_attn_{'bwd_' * (name != 'fwd')}{name}", (Hkv, n) if name in heads_first else (n, Hkv))
                for name, n in places.items()]
        assert sorted(grids) == sorted(want), (heads_first, grids)
    block_attn.HEADS_FIRST = default
    for other in results[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), results[0], other):
            assert torch.equal(a, b), name


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
@pytest.mark.parametrize("blocks", [1, 2])
def test_kernels_match_dense_attention_in_the_triton_interpreter(blocks):
    run = triton_interp.run("test_block_attn", f"check_interpreter({blocks})")
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_tiles_seen_whole_skip_the_mask_with_the_same_results_in_the_triton_interpreter():
    run = triton_interp.run("test_block_attn", "check_whole_tiles()")
    assert run.returncode == 0, run.stderr[-3000:]


def test_heads_first_spreads_the_dkv_programs_of_the_bench_rows_over_the_sms():
    """bench/dkv_balance.py's model of the 8B step's dK/dV launch (192 programs, one an SM of 132): started
    head by head, the last heads' longest tiles begin after the first heads' shortest end, and the last SM
    finishes at ~1.5x a perfect spread; heads first, ~1.1x. The model's parts on a case worked by hand."""
    import dkv_balance
    from common import DRAFTERS

    assert dkv_balance.dispatch([4, 1, 1], 2, True) == [4, 4, 1, 1, 1, 1]
    assert dkv_balance.dispatch([4, 1, 1], 2, False) == [4, 1, 1, 4, 1, 1]
    # 3 SMs: the two 4s first, the 1s on the third SM, all done at 4 = 12 / 3; head by head the second 4
    # starts at 1, when the first 1 ends, and ends at 5.
    assert dkv_balance.spread([4, 4, 1, 1, 1, 1], 3, 1) == 1.0
    assert dkv_balance.spread([4, 1, 1, 4, 1, 1], 3, 1) == 4 / 5
    places, _, _ = dkv_balance.programs(DRAFTERS["qwen3_8b"], 0)["dkv"]
    first, by_head = (dkv_balance.spread(dkv_balance.dispatch(places, 8, hf), 132, 1) for hf in (True, False))
    assert first > 0.85 and by_head < 0.7, (first, by_head)


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_the_kernels_named_start_their_programs_longest_first_over_all_kv_heads_with_the_same_results():
    run = triton_interp.run("test_block_attn", "check_heads_first()")
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_kernels_match_dense_attention_on_cuda(compiled):
    """bf16 at 8B-like head shapes (32 query heads over 8 KV heads, D = 128), eager and compiled: two
    blocks per program in the forward and dQ (the default), then one block with the tiles it ran with
    before."""
    from dflash_mp.model import block_attn

    torch._dynamo.reset()
    tiles = dict(block_attn.TILES)
    try:
        for name, changes in (("pairs", {}),
                              ("one block", dict(q_blocks=1, fwd_warps=4, dq_warps=4, DQ_BLOCK_N=128, dq_stages=2))):
            block_attn.TILES.update(tiles, **changes)
            for window in (None, 64):
                errors = compare(1024, 64, 16, 32, 8, 128, window, [300, 500, 100], "cuda", torch.bfloat16, compiled)
                assert max(errors.values()) < 2e-2, (name, window, errors)
    finally:
        block_attn.TILES.update(tiles)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs CUDA with TMA (sm_90+)")
@pytest.mark.parametrize("compiled", [False, True])
def test_context_tiles_through_descriptors_and_through_pointers_both_match_dense_attention_on_cuda(compiled):
    """The same bf16 inputs at 8B-like head shapes (D = 128), the context tiles through tensor
    descriptors (forced) and through pointers, full and sliding: both within the dense path's tolerance."""
    from dflash_mp.model import block_attn

    torch._dynamo.reset()
    try:
        for tma in (True, False):
            block_attn.USE_TMA = tma
            for window in (None, 64):
                errors = compare(1024, 64, 16, 32, 8, 128, window, [300, 500, 100], "cuda", torch.bfloat16,
                                 compiled)
                assert max(errors.values()) < 2e-2, (tma, window, errors)
    finally:
        block_attn.USE_TMA = None


def test_context_tiles_come_through_descriptors_only_where_the_device_and_the_layout_allow():
    """Auto: pointers on CPU (no TMA); forced: descriptors, but pointers still for a base or a stride
    that is not 16-byte aligned; off: pointers."""
    k = torch.zeros(40, 2, 16)
    view = torch.zeros(40, 3, 16)[:, :2]  # not contiguous, rows 192 bytes apart: aligned
    odd = torch.zeros(40 * 32 + 1)[1:].view(40, 2, 16)  # a base 4 bytes past an aligned one
    narrow = torch.zeros(40, 2, 6)  # heads 24 bytes apart
    assert not use_tma(None, k, k)
    assert use_tma(True, k, k) and use_tma(True, k, view)
    assert not use_tma(True, k, odd) and not use_tma(True, narrow, narrow)
    assert not use_tma(False, k, k)


def check_drafter() -> None:
    """A drafter of one sliding and one full layer: loss and every gradient with the kernels equal
    the dense path's (fp32)."""
    from dflash_mp.model import DFlashDrafter, DrafterArgs
    from dflash_mp.model.anchors import build_blocks

    T, A, B, H = 96, 5, 16, 32
    args = DrafterArgs(hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=64, target_layer_ids=[1, 2], mask_token_id=63, block_size=B,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=24)
    torch.manual_seed(0)
    drafter = DFlashDrafter(args)
    anchors, valid, docs = make_row(T, A, [40, 50])
    pos = torch.cat([torch.arange(40), torch.arange(50), torch.zeros(6, dtype=torch.long)])
    hidden = torch.randn(T, 2 * H)
    _, block_pos = build_blocks(torch.zeros(T, dtype=torch.long), pos, anchors, B, 63)
    embeds = torch.randn(A * B, H)
    results = {}
    for backend in ("dense", "triton"):
        drafter.zero_grad(set_to_none=True)
        out = drafter(hidden, embeds, pos, block_pos, drafter.build_attention(anchors, valid, docs, backend=backend))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results[backend] = (out.detach(), [p.grad.clone() for p in drafter.parameters()])
    torch.testing.assert_close(results["triton"][0], results["dense"][0], atol=1e-5, rtol=1e-5)
    for got, want in zip(results["triton"][1], results["dense"][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

    # Compiled under bf16 autocast with fp32 block inputs: q and k reach the kernels in fp32 (RoPE in
    # the inputs' dtype), v in bf16, and the backward's outputs must have the dtypes its fake says.
    def step(backend):
        out = drafter(hidden, embeds, pos, block_pos, drafter.build_attention(anchors, valid, docs, backend=backend))
        return (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()

    compiled = torch.compile(step)
    losses = {}
    for backend, fn in (("dense", step), ("triton", compiled)):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = fn(backend)
        loss.backward()
        losses[backend] = (loss.detach(), [p.grad.clone() for p in drafter.parameters()])
    torch.testing.assert_close(losses["triton"][0], losses["dense"][0], atol=0.1, rtol=0.02)
    for got, want in zip(losses["triton"][1], losses["dense"][1]):
        assert torch.isfinite(got).all() and (got - want).norm() <= 0.05 * want.norm() + 1e-6


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_a_drafter_with_the_kernels_equals_the_dense_one_in_the_triton_interpreter():
    run = triton_interp.run("test_block_attn", "check_drafter()")
    assert run.returncode == 0, run.stderr[-3000:]


def check_stage_fallback() -> None:
    """A kernel whose tiles overflow shared memory at 3 stages runs with 2; the choice is kept."""
    from triton.runtime.errors import OutOfResources

    from dflash_mp.triton_launch import launch

    calls = []

    class Kernel:
        def __getitem__(self, grid):
            def run_kernel(*args, num_warps, num_stages, **meta):
                calls.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(262144, 232448, "shared memory")
            return run_kernel

    kernel = Kernel()
    launch(kernel, (1,), (), {"BLOCK_N": 128}, 4, 3, torch.device("cpu"))
    launch(kernel, (1,), (), {"BLOCK_N": 128}, 4, 3, torch.device("cpu"))
    assert calls == [3, 2, 2], calls
    calls.clear()
    try:

        class Never(Kernel):
            def __getitem__(self, grid):
                def run_kernel(*args, num_warps, num_stages, **meta):
                    calls.append(num_stages)
                    raise OutOfResources(1, 0, "shared memory")
                return run_kernel

        launch(Never(), (1,), (), {"BLOCK_N": 32}, 4, 2, torch.device("cpu"))
    except OutOfResources:
        assert calls == [2, 1], calls
    else:
        raise AssertionError("a kernel that never fits must raise")


@pytest.mark.skipif(not triton_interp.HAS_TRITON, reason=triton_interp.SKIP_REASON)
def test_tiles_too_large_for_shared_memory_fall_back_to_fewer_stages():
    run = triton_interp.run("test_block_attn", "check_stage_fallback()")
    assert run.returncode == 0, run.stderr[-3000:]


def test_bench_block_kernel_settings_hold_for_the_body_and_come_back_after_an_error():
    """The benches' variants change block_attn's module settings for one run; a variant that raises must
    not leave them changed for the runs after it (bench/common.block_kernel_settings)."""
    from common import block_kernel_settings
    from dflash_mp.model import block_attn
    from flex_tiles import triton_settings

    before = dict(block_attn.TILES), block_attn.USE_TMA, block_attn.HEADS_FIRST, block_attn.WHOLE_TILES
    with pytest.raises(RuntimeError, match="variant failed"):
        with block_kernel_settings(**triton_settings("triton-pairq-n128-masked-ptr")):
            assert block_attn.TILES["BLOCK_N"] == 128 and block_attn.TILES["fwd_stages"] == 2
            assert block_attn.USE_TMA is False and block_attn.WHOLE_TILES is False
            block_attn.TILES["extra"] = 1
            raise RuntimeError("variant failed")
    assert (dict(block_attn.TILES), block_attn.USE_TMA, block_attn.HEADS_FIRST, block_attn.WHOLE_TILES) == before
    with block_kernel_settings(heads_first=frozenset()):
        assert block_attn.HEADS_FIRST == frozenset() and block_attn.TILES == before[0]
    assert block_attn.HEADS_FIRST == before[2]
    assert triton_settings("bwd32") == {}
