"""FlatAdamW: the trainer's weights, gradients and optimizer state in flat buffers it owns."""

import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.optim import FlatAdamW, adamw_update, halves_of, held_bytes_per_param, master_of
from dflash_mp.trainer import DFlashObjective, DrafterConfig, DrafterTrainer, TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import synthetic_batch  # noqa: E402

ARGS = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
            vocab_size=128, target_layer_ids=[1, 2], block_size=8, mask_token_id=127)


def _trainer(grad_clip: float = 1.0, precision: str = "fp32", group=None, direct: bool = True, layers: int = 1,
             overlap: bool = True, write_grads: bool = True, split_master: bool = True) -> DrafterTrainer:
    args = DrafterArgs(**{**ARGS, "num_layers": layers})
    torch.manual_seed(0)
    obj = DFlashObjective(DFlashDrafter(args), args, torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02,
                          DrafterConfig(num_layers=layers, block_size=8, num_anchors=8, max_anchors_per_doc=4,
                                        loss_chunk_size=16))
    cfg = TrainConfig(compile="eager", warmup_ratio=0.0, lr=1e-2, grad_clip=grad_clip, weight_decay=0.1,
                      precision=precision, optimizer_overlap=overlap)
    return DrafterTrainer(obj, cfg, 10, group, torch.device("cpu"), write_grads=write_grads,
                          direct_grads=direct, split_master=split_master)


def _batch(seed: int = 0):
    return synthetic_batch(64, 2 * 32, 128, "cpu", torch.float32, seed=seed, lo=16, hi=40)


def _inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return lo <= t.data_ptr() < hi


def _scheme(name: str, **kw) -> DrafterTrainer:
    """direct: the update reads `.grad`; flat: `.grad` copied into the buffer; add: `.grad` views of it."""
    tr = _trainer(direct=name == "direct", write_grads=name != "add", **kw)
    assert tr.opt.direct == (name == "direct")
    return tr


@pytest.mark.parametrize("scheme", ["flat", "add"])
def test_gradients_land_in_one_buffer_that_steps_reuse(scheme):
    tr = _scheme(scheme)
    flat = tr.opt.grad
    assert all(_inside(p, tr.opt.master) for p in tr.params)  # fp32: the working weights are the master
    for step in range(2):
        tr.set_lr()
        tr.forward_backward(_batch(step))
        if scheme == "flat":  # written into the buffer, the .grad tensors dropped
            assert all(p.grad is None for p in tr.params)
        else:  # backward added into views of the buffer
            assert all(_inside(p.grad, flat) for p in tr.params)
        assert flat.abs().sum() > 0
        before = tr.opt.master.clone()
        tr.optimizer_step()
        assert not torch.equal(before, tr.opt.master)
        assert flat.data_ptr() == tr.opt.grad.data_ptr()


def test_one_replica_updates_from_grad_without_a_gradient_buffer():
    """The default on one replica: backward's `.grad` tensors are what the update reads, then they
    are dropped so the next backward writes fresh ones; no flat gradient buffer exists."""
    tr = _trainer()
    assert tr.opt.direct and tr.opt.grad is None and tr.opt.grad_views == []
    flat = _scheme("flat").opt
    assert tr.opt.num_bytes_per_step == flat.num_bytes_per_step  # the same bytes, read from elsewhere
    for step in range(2):
        tr.set_lr()
        tr.forward_backward(_batch(step))
        grads = [p.grad for p in tr.params]
        assert all(g is not None and not _inside(g, tr.opt.master) for g in grads)
        assert all(a is b for a, b in zip(tr.opt.gradients(), grads))
        before = tr.opt.master.clone()
        tr.optimizer_step()
        assert not torch.equal(before, tr.opt.master)
        assert all(p.grad is None for p in tr.params)
        assert tr.opt.grad is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_written_and_added_gradients_give_the_same_steps(precision):
    """Two backwards per step (gradient accumulation): autograd's sums into `.grad` (direct), the
    copy then add into the buffer (flat) and autograd's adds into its views (add) are the same sums,
    and give the same steps bit for bit (clipping off: the same divisor)."""
    runs = {}
    for scheme in ("direct", "flat", "add"):
        tr = _scheme(scheme, grad_clip=0.0, precision=precision)
        torch.manual_seed(3)
        out = []
        for step in range(3):
            tr.set_lr()
            for micro in range(2):  # accumulation: the second backward adds to the first
                tr.forward_backward(_batch(2 * step + micro), grad_scale=0.5)
            out.append(torch.cat([g.flatten() for g in tr.opt.gradients()]))
            tr.optimizer_step()
        out += [tr.opt.master.clone(), tr.opt.exp_avg.clone(), tr.opt.exp_avg_sq.clone(), tr.opt.work.clone()]
        runs[scheme] = out
    for other in ("flat", "add"):
        assert all(torch.equal(a, b) for a, b in zip(runs["direct"], runs[other])), other


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("clip", [0.0, 1e-2])
@pytest.mark.parametrize("segments", [False, True])
def test_direct_and_flat_gradients_give_the_same_steps(precision, clip, segments):
    """Several steps, in one segment or one per layer: the same weights and moments, bit for bit
    without clipping. With it the norm is summed per tensor, then over them: the first step agrees
    to fp32 rounding; later ones compute gradients at weights that differ by that rounding, which
    Adam's normalisation lifts for near-zero gradients, so they are not compared
    (test_a_weight_backward_did_not_reach_has_a_zero_gradient compares several clipped steps on
    the same gradients)."""
    runs = {}
    for scheme in ("direct", "flat"):
        tr = _scheme(scheme, grad_clip=clip, precision=precision, layers=2, overlap=segments)
        assert len(tr.opt._segments) == (3 if segments else 1)
        torch.manual_seed(3)
        out = []
        for step in range(4):
            tr.train_step(_batch(step))
            out.append(([tr.opt.master.clone(), tr.opt.exp_avg.clone(), tr.opt.exp_avg_sq.clone(),
                         tr.opt.work.clone(), tr.opt.step.clone()], tr.stats.pop()["gnorm_sum"]))
        runs[scheme] = out
    for step, ((got, gnorm), (want, want_gnorm)) in enumerate(zip(runs["direct"], runs["flat"])):
        if clip and step == 0:
            assert want_gnorm > clip  # clipping bites
            torch.testing.assert_close(gnorm, want_gnorm, rtol=1e-6, atol=0)
        if clip and step > 0:
            break
        for a, b in zip(got, want):
            if not clip:
                assert torch.equal(a, b)
            else:  # bf16 working weights: a rounding may flip one unit in the last place
                ulp = 2.0 ** -7 if a.dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(a, b, rtol=ulp, atol=1e-8)


def _toy_steps(direct: bool, clip: float, use: list[tuple[str, ...]], accumulate: int = 1):
    """FlatAdamW on three weights, each step's loss reaching only the weights in `use[step]`; the
    gradients do not depend on the weights (a linear loss), so both schemes see the same ones."""
    torch.manual_seed(0)
    ps = {n: torch.nn.Parameter(torch.randn(*s)) for n, s in (("a", (4, 3)), ("b", (5,)), ("c", (2, 2)))}
    opt = FlatAdamW(list(ps.items()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, direct_grads=direct,
                    segments=[["a"], ["b", "c"]])
    assert opt.direct == direct
    g = torch.Generator().manual_seed(1)
    gnorms, seen = [], []
    for step, names in enumerate(use):
        for micro in range(accumulate):
            loss = sum((ps[n] * torch.randn(ps[n].shape, generator=g)).sum() for n in names)
            loss.backward()
            opt.collect()
        seen.append([t.clone() for t in opt.gradients()])
        gnorms.append(opt.step_(clip)[0])
    return opt, gnorms, seen


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_weight_backward_did_not_reach_has_a_zero_gradient(clip):
    """Direct: a `.grad` left None counts as zeros (weight decay still moves the weight), over
    several steps of two backwards each, in two segments, the same as the flat scheme's."""
    use = [("a", "c"), ("a",), ("b", "c"), ("c",)]
    (d, dn, dseen), (f, fn, fseen) = (_toy_steps(direct, clip, use, accumulate=2) for direct in (True, False))
    assert torch.equal(dseen[1][1], torch.zeros(5)) and torch.equal(dseen[1][2], torch.zeros(2, 2))
    for a, b in zip(dseen, fseen):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for x, y in zip(dn, fn):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=0)
    assert all(float(n) > clip for n in fn)  # clipping bites when on
    for name in ("master", "exp_avg", "exp_avg_sq", "step"):
        if clip:
            torch.testing.assert_close(getattr(d, name), getattr(f, name), rtol=1e-6, atol=1e-8)
        else:
            assert torch.equal(getattr(d, name), getattr(f, name)), name
    assert float(d.step) == 4


def test_the_trainer_keeps_the_flat_buffer_where_grad_is_not_the_updates_to_read():
    """CUDA graphs may leave `.grad` in a graph's output pool; a bucketed all-reduce fills the buffer
    (on 2 ranks: test_the_bucketed_all_reduce_during_backward_gives_the_same_steps); with one replica
    `overlap_reduce` has nothing to sum and changes nothing."""
    assert _trainer().opt.direct  # eager on one replica
    for mode in ("reduce-overhead", "max-autotune"):
        args = DrafterArgs(**ARGS)
        obj = DFlashObjective(DFlashDrafter(args), args, torch.randn(128, 32), torch.randn(128, 32),
                              DrafterConfig(block_size=8, num_anchors=8, max_anchors_per_doc=4))
        tr = DrafterTrainer(obj, TrainConfig(compile=mode), 10, None, torch.device("cpu"))
        assert not tr.opt.direct and tr.opt.grad is not None, mode
    ps = [("a", torch.nn.Parameter(torch.randn(4)))]
    assert FlatAdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, overlap_reduce=True).direct


def test_bench_flatgrads_mode_keeps_the_copy():
    import drafter_step
    from common import DRAFTERS

    assert drafter_step.parse_mode("default+ce=triton+flatgrads") == ("default", {"ce": "triton", "flatgrads": True})
    for mode, direct in (("eager", True), ("eager+flatgrads", False)):
        tr = drafter_step.build(DRAFTERS["tiny"], mode, torch.device("cpu"), 64, "layers")
        assert tr.opt.direct == direct


def test_the_compiled_update_takes_its_pointwise_configs_untimed(monkeypatch):
    """Timed, Inductor would run each config of the update's kernels at the first step on clones of the
    buffers it writes (2.6 GiB of segments more at the 27B drafter's first step, BENCHMARKS.md call Q14):
    the update is compiled with pointwise autotuning off, the gradient norm as before."""
    calls = []
    real = torch.compile

    def recording(fn, **kwargs):
        calls.append((fn.__name__, kwargs.get("options")))
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    ps = [("w", torch.nn.Parameter(torch.randn(4, 4)))]
    FlatAdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, compiled=True)
    want = {"adamw_update_each": {"triton.autotune_pointwise": False}, "global_norm_sums": None}
    assert dict(calls) == want


def test_identical_layers_share_one_compiled_direct_update():
    """Compiled, the direct update takes per-parameter lists; equal layers must not recompile. The
    compiled gradient norm equals the eager one."""
    from dflash_mp.compile_stats import counts

    torch._dynamo.reset()
    shapes = {"w1": (8, 4), "norm": (4,), "w2": (4, 8)}
    named = [("fc.weight", (6, 4))] + [(f"layers.{i}.{k}", s) for i in range(3) for k, s in shapes.items()]
    runs = []
    for compiled in (True, False):
        torch.manual_seed(0)
        ps = [(n, torch.nn.Parameter(torch.randn(*s))) for n, s in named]
        segments = [["fc.weight"]] + [[f"layers.{i}.{k}" for k in shapes] for i in range(3)]
        opt = FlatAdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, dtype=torch.bfloat16,
                        compiled=compiled, segments=segments)
        assert opt.direct
        before = counts()["graphs"]
        norms = []
        for step in range(2):
            loss = sum((p.float() ** 2).sum() * (k + 1) for k, (n, p) in enumerate(ps) if n != "layers.0.norm")
            loss.backward()
            opt.collect()
            norms.append(opt.step_(1.0)[0])
            if step == 0:
                first = counts()["graphs"]
        if compiled:  # the norm, fc's segment and one for the three layers (layers.0.norm's zeros too); none later
            assert first - before == 3 and counts()["graphs"] == first
        runs.append([torch.stack(norms), opt.master.clone(), opt.exp_avg_sq.clone(), opt.work.clone()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _reference_step(tr: DrafterTrainer, clip: float):
    """torch's clip_grad_norm_ + AdamW on fp32 copies of the weights, with the trainer's gradients."""
    ref = [torch.nn.Parameter(w.detach().clone()) for w in tr.opt.named_master().values()]
    for r, g in zip(ref, tr.opt.gradients()):
        r.grad = g.float().clone()
    norm = torch.nn.utils.clip_grad_norm_(ref, clip) if clip > 0 else None
    torch.optim.AdamW(ref, lr=tr.opt.lr, betas=tr.cfg.betas, weight_decay=0.1, foreach=False).step()
    return ref, norm


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("clip", [1e-3, 1e6, 0.0])  # clipping bites / never bites / disabled
def test_clip_and_update_equal_clip_grad_norm_then_torch_adamw(clip, direct):
    tr = _trainer(clip, direct=direct)
    init = [p.detach().clone() for p in tr.params]
    tr.set_lr()
    tr.forward_backward(_batch())
    ref, norm = _reference_step(tr, clip)
    tr.optimizer_step()
    assert sum(float((p.detach() - i).abs().sum()) for p, i in zip(tr.params, init)) > 0
    for r, p in zip(ref, tr.params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-7)
    stats = tr.stats.pop()
    if norm is not None:
        torch.testing.assert_close(stats["gnorm_sum"].float(), norm, rtol=1e-5, atol=0)
    assert stats["skipped"] == 0


@pytest.mark.parametrize("direct", [True, False])
def test_bf16_working_weights_follow_fp32_master_weights(direct):
    """precision=bf16: the model computes with bf16 views, AdamW updates fp32 master weights."""
    tr = _trainer(1.0, "bf16", direct=direct)
    assert tr.opt.work.dtype == torch.bfloat16 and (direct or tr.opt.grad.dtype == torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and _inside(p, tr.opt.work) for p in tr.params)
    ref = [torch.nn.Parameter(w.detach().clone()) for w in tr.opt.named_master().values()]
    opt = torch.optim.AdamW(ref, lr=1.0, betas=tr.cfg.betas, weight_decay=0.1, foreach=False)
    ties = 0
    for step in range(3):
        tr.set_lr()
        tr.forward_backward(_batch(step))
        for r, g in zip(ref, tr.opt.gradients()):
            assert g.dtype == torch.bfloat16
            r.grad = g.float().clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt.param_groups[0]["lr"] = tr.opt.lr
        opt.step()
        tr.optimizer_step()
        master = tr.opt.named_master()
        for r, name in zip(ref, tr.opt.names):
            # The same update to fp32 weights: updates far below bf16's resolution still land.
            torch.testing.assert_close(master[name], r.detach(), rtol=1e-5, atol=1e-6)
        # The working weights are the master rounded to nearest; an exact tie (its lower 16 bits 0x8000)
        # goes away from zero, to the other of the two equally near bf16 values (the split master's rounding).
        work, want = tr.opt.work, tr.opt.master
        tie = (want.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(work[~tie], want[~tie].bfloat16())
        assert (work[tie].float().abs() > want[tie].abs()).all()
        assert torch.equal((work[tie].float() - want[tie]).abs(), (want[tie].bfloat16().float() - want[tie]).abs())
        ties += int(tie.sum())
        assert any(not torch.equal(r.detach().bfloat16().float(), r.detach()) for r in ref)
    assert ties > 0  # updates of lr 1.0 leave few low bits: exact ties occur, and are checked, here


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU kernel needs a GPU")])])
def test_compiled_update_equals_eager_update(device):
    torch.set_default_device(device)
    try:
        _compare_update(torch.Generator(device).manual_seed(0))
    finally:
        torch.set_default_device("cpu")


def _compare_update(g):
    n = 3000
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    compiled = torch.compile(adamw_update, dynamic=False, fullgraph=True)
    for skip in (0.0, 1.0, 0.0):
        bufs = [torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g),
                torch.rand(n, generator=g), torch.zeros(n, dtype=torch.bfloat16), torch.tensor(3.0),
                torch.tensor(1e-3), torch.tensor(2.0), torch.tensor(skip)]
        orig_master = bufs[0].clone()
        eager = [b.clone() for b in bufs]
        adamw_update(*eager, **hyper)
        compiled(*bufs, **hyper)
        for a, b in zip(eager, bufs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        # A skipped step leaves the weights as they were; a taken one moves every weight.
        unchanged = int((bufs[0] == orig_master).sum())
        assert unchanged == n if skip else unchanged < n // 100
        assert float(bufs[5]) == 3.0  # the caller counts steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU kernel needs a GPU")])])
def test_the_split_master_is_an_fp32_master_bit_for_bit(device):
    """bf16 working weights plus int16 lower halves hold every fp32 value exactly (zeros, subnormals, the
    largest, infinities), the upper half rounded to nearest; the update through them, eager and compiled,
    leaves the very master, moments and (off exact ties) working weights an fp32 master gets."""
    g = torch.Generator().manual_seed(0)
    n = 4000
    master = torch.randn(n, generator=g) * torch.logspace(-38, 38, n)
    master[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), float("-inf")])
    master = master.to(device)
    work, low = halves_of(master)
    assert work.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(master_of(work, low).view(torch.int32), master.view(torch.int32))
    tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(work[~tie], master[~tie].bfloat16())
    master, work, low = master[8:], work[8:], low[8:]  # the update on finite weights
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    compiled = torch.compile(adamw_update, dynamic=False, fullgraph=True)
    for skip in (0.0, 1.0):
        grad = torch.randn(n - 8, generator=g).bfloat16().to(device)
        m, v = torch.randn(n - 8, generator=g).to(device), torch.rand(n - 8, generator=g).to(device)
        scalars = [torch.tensor(x, device=device) for x in (3.0, 1e-3, 2.0, skip)]
        for fn in (adamw_update, compiled):
            full = [master.clone(), grad, m.clone(), v.clone(), torch.zeros_like(work), *scalars]
            split = [low.clone(), grad, m.clone(), v.clone(), work.clone(), *scalars]
            fn(*full, **hyper)
            fn(*split, **hyper)
            assert torch.equal(master_of(split[4], split[0]).view(torch.int32), full[0].view(torch.int32))
            assert torch.equal(split[2], full[2]) and torch.equal(split[3], full[3])
            tie = (full[0].view(torch.int32) & 0xFFFF) == 0x8000
            assert torch.equal(split[4][~tie], full[4][~tie])
            assert skip == 0.0 or torch.equal(split[0], low) and torch.equal(split[4], work)


def test_the_split_master_is_made_one_parameter_at_a_time(monkeypatch):
    """At start the halves are made parameter by parameter: no temporaries the size of all the weights
    (an fp32 master and int32 bits: ~12 bytes a parameter, ~13 GB at 8B, for the allocator to keep)."""
    from dflash_mp import optim

    sizes = []
    split = optim.halves_of
    monkeypatch.setattr(optim, "halves_of", lambda m: sizes.append(m.numel()) or split(m))
    tr = _trainer(1.0, "bf16")
    assert sizes == [p.numel() for p in tr.params] and max(sizes) < tr.opt.work.numel() // 2


def test_a_checkpoint_copies_the_split_master_one_parameter_at_a_time(monkeypatch):
    """The checkpoint's host copy (checkpoint.snapshot of the trainer's state) gets every trainable
    weight's fp32 master, joined from its halves as it is read: at most two joined copies exist at
    once (the one being copied and the one before it), not the whole master's 4 bytes a parameter."""
    import weakref

    from dflash_mp import optim
    from dflash_mp.checkpoint import snapshot

    tr = _trainer(1.0, "bf16")
    assert tr.opt.split and tr.opt._master.dtype == torch.int16
    tr.train_step(_batch(0))
    want = {n: m.clone() for n, m in tr.opt.named_master().items()}
    alive, most = [], [0]
    join = optim.master_of

    def counted(work, low):
        out = join(work, low)
        alive.append(weakref.ref(out))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return out

    monkeypatch.setattr(optim, "master_of", counted)
    state = snapshot(tr.state_dict())
    assert len(alive) == len(tr.opt.names) > 4 and most[0] <= 2, (len(alive), most[0])
    drafter = state["drafter"]
    assert list(drafter) == list(tr.objective.drafter.state_dict())  # the drafter's names and order
    for name, m in want.items():
        assert drafter[name].dtype == torch.float32 and torch.equal(drafter[name], m), name


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradients_skip_the_update_and_are_counted(direct, bad):
    tr = _trainer(direct=direct, layers=2)
    tr.train_step(_batch())
    before = [p.detach().clone() for p in tr.params]
    moments = tr.opt.exp_avg.clone()
    tr.set_lr()
    tr.forward_backward(_batch())
    tr.opt.gradients()[-1].view(-1)[0] = bad  # the `.grad` itself (direct) or its place in the buffer
    tr.optimizer_step()
    for b, p in zip(before, tr.params):
        assert torch.equal(b, p.detach())
    assert torch.equal(moments, tr.opt.exp_avg)
    assert float(tr.opt.step) == 1  # the skipped step does not count for bias correction
    assert tr.stats.pop()["skipped"] == 1
    tr.train_step(_batch())  # the bad gradient is gone: the next step's overwrite it
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, tr.params))
    assert tr.stats.pop()["skipped"] == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_round_trip_resumes_the_same_run(precision):
    a = _trainer(precision=precision)
    for s in range(2):
        a.train_step(_batch(s))
    state = a.state_dict()
    assert all(v.dtype == torch.float32 for v in state["drafter"].values())  # checkpoints hold master weights
    b = _trainer(precision=precision)
    b.train_step(_batch(3))  # another state: everything must come from the checkpoint
    b.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    for name in ("master", "work", "exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(getattr(a.opt, name), getattr(b.opt, name)), name
    torch.manual_seed(5)
    a.train_step(_batch(2))
    torch.manual_seed(5)
    b.train_step(_batch(2))
    assert torch.equal(a.opt.master, b.opt.master)
    with pytest.raises(ValueError, match="checkpoint lacks"):
        b.load_state_dict({"drafter": {}, "optimizer": {}, "step": 0})


def _rank_bf16_step(rank, world_size):
    """One data-parallel step in bf16: each rank its own batch, gradients summed in fp32."""
    import torch.distributed as dist

    tr = _trainer(1.0, "bf16", group=dist.group.WORLD)
    assert tr.opt.world == world_size
    assert not tr.opt.direct and tr.opt.grad is not None  # the all-reduce sums the flat buffer
    tr.set_lr()
    tr.forward_backward(_batch(rank))
    own = tr.opt.grad.clone()
    tr.opt.allreduce()
    summed = tr.opt._grad().clone()
    tr.optimizer_step()
    held = (tr.opt.held_bytes, sum(p.numel() for p in tr.opt.params))
    return own, summed, tr.opt.master.clone(), float(tr.stats.pop()["gnorm_sum"]), held


@pytest.mark.parametrize("layers", [1, 2])
def test_the_step_form_gives_every_row_through_every_layer_s_loss_and_gradients(layers):
    """The objective hands the drafter the anchors' rows and the mask token's row and reads slots 1..B-1
    only (DFlashDrafter.forward's training form): the same loss and gradients as the general form."""
    runs = []
    for shared in (True, False):
        tr = _trainer(layers=layers)
        tr.objective.shared_mask_rows = shared
        torch.manual_seed(3)  # the same anchors
        loss = tr.forward_backward(_batch())
        runs.append((loss, tr.opt.gradients()))
    (loss, grads), (ref_loss, ref_grads) = runs
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g, r in zip(tr.opt.names, grads, ref_grads):
        assert r.abs().sum() > 0, name
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)


def test_a_cpu_step_never_calls_into_torch_cuda(monkeypatch):
    """On a CUDA machine any torch.cuda stream call creates a CUDA context: GPU memory for a CPU rank,
    and an error in a forked process (the gloo tests' ranks)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU training step called into torch.cuda")

    for name in ("stream", "current_stream", "Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    for direct in (True, False):
        tr = _trainer(direct=direct, layers=2)
        tr.train_step(_batch())
        assert tr.step == 1


def test_bf16_gradients_are_averaged_in_fp32_across_ranks():
    (g0, s0, m0, n0, (held, n)), (g1, s1, m1, n1, _) = run_ranks(_rank_bf16_step, 2, timeout=120)
    assert held == n * held_bytes_per_param(torch.bfloat16, replicas=2)  # the planner's memory floor
    assert g0.dtype == torch.bfloat16 and s0.dtype == torch.float32
    assert not torch.equal(g0, g1)  # different batches
    expected = g0.float() + g1.float()  # exact in fp32
    assert torch.equal(s0, expected) and torch.equal(s1, expected)
    assert torch.equal(m0, m1)  # every replica took the same step
    mean_norm = float(torch.linalg.vector_norm(expected / 2))
    assert abs(n0 - mean_norm) <= 1e-5 * mean_norm and n0 == n1


@pytest.mark.parametrize("precision,direct,split", [("fp32", True, True), ("bf16", True, True),
                                                    ("bf16", False, True), ("bf16", True, False)])
def test_the_planner_counts_the_bytes_the_optimizer_and_the_gradients_hold(precision, direct, split):
    """`held_bytes_per_param` (the planner's memory floor, plan.memory_floor) against the tensors one
    replica holds after a backward: its buffers and the gradients, `.grad` (direct) or the flat buffer."""
    tr = _trainer(precision=precision, direct=direct, split_master=split)  # not split: a separate fp32 master
    tr.set_lr()
    tr.forward_backward(_batch())
    assert tr.opt.split == (split and precision == "bf16") and tr.opt.direct == direct
    n = sum(p.numel() for p in tr.opt.params)
    assert tr.opt.held_bytes == n * held_bytes_per_param(tr.opt.work.dtype, split)


def test_update_in_segments_equals_one_update_and_follows_the_forward():
    """Eager mode splits the update per layer (on CUDA, on a side stream); the forward asks for
    each module's weights in the order it runs them."""
    seen = []
    runs = []
    for overlap in (True, False):
        args = DrafterArgs(**{**ARGS, "num_layers": 3})
        torch.manual_seed(0)
        drafter = DFlashDrafter(args)
        obj = DFlashObjective(drafter, args, torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02,
                              DrafterConfig(num_layers=3, block_size=8, num_anchors=8, max_anchors_per_doc=4,
                                            loss_chunk_size=16))
        cfg = TrainConfig(compile="eager", warmup_ratio=0.0, lr=1e-2, weight_decay=0.1, optimizer_overlap=overlap)
        tr = DrafterTrainer(obj, cfg, 10, None, torch.device("cpu"))
        assert len(tr.opt._segments) == (4 if overlap else 1)
        if overlap:
            wait = tr.opt.wait
            drafter.before_module = lambda name: (seen.append(name), wait(name))
        torch.manual_seed(3)
        for step in range(3):
            tr.train_step(_batch(step))
        runs.append((tr.opt.master.clone(), tr.opt.exp_avg_sq.clone(), float(tr.opt.step)))
    assert seen[:5] == ["fc", "hidden_norm", "layers.0", "layers.1", "layers.2"] and seen[5] == "norm"
    assert len(seen) == 3 * 6
    (m1, v1, s1), (m2, v2, s2) = runs
    assert torch.equal(m1, m2) and torch.equal(v1, v2) and s1 == s2 == 3.0


def test_segments_must_be_contiguous_runs_covering_every_parameter():
    ps = [(n, torch.nn.Parameter(torch.randn(4))) for n in ("a", "b", "c")]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    with pytest.raises(ValueError, match="not a contiguous run"):
        FlatAdamW(ps, segments=[["a", "c"], ["b"]], **kw)
    with pytest.raises(ValueError, match="every trainable parameter once"):
        FlatAdamW(ps, segments=[["a", "b"]], **kw)
    with pytest.raises(ValueError, match="unknown: \\['d'\\]"):
        FlatAdamW(ps, segments=[["a", "b", "c", "d"]], **kw)
    opt = FlatAdamW(ps, segments=[["c"], ["a", "b"]], **kw)
    assert [sorted(names) for names, _ in opt._segments] == [["c"], ["a", "b"]]
    assert opt._segments[0][1][0][0].data_ptr() == opt.master[8:].data_ptr()  # direct: c's view
    flat = FlatAdamW(ps, segments=[["c"], ["a", "b"]], direct_grads=False, **kw)
    assert flat._segments[0][1][0][0].data_ptr() == flat.master[8:].data_ptr()  # flat: the run's slice


def test_lr_schedule_warms_up_linearly_then_follows_the_cosine_to_its_floor():
    from dflash_mp.trainer import lr_at

    # 11 steps, warm-up ceil(0.25 * 11) = 3 steps, then cosine over the remaining 8 down to 0.1.
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.25, min_lr_ratio=0.1)
    c = 0.5 ** 0.5  # cos(pi/4)
    want = [1 / 3, 2 / 3, 1.0,  # warm-up: (step + 1) / 3
            1.0, 0.1 + 0.45 * (1 + 0.92387953), 0.1 + 0.45 * (1 + c), 0.1 + 0.45 * (1 + 0.38268343),
            0.55,  # half way (progress 4/8): the midpoint of 1.0 and the floor
            0.1 + 0.45 * (1 - 0.38268343), 0.1 + 0.45 * (1 - c), 0.1 + 0.45 * (1 - 0.92387953),
            0.1, 0.1]  # the floor, and it stays there past the last step
    got = [lr_at(s, 11, cfg) for s in range(13)]
    assert got == pytest.approx(want, rel=1e-7)
    # warmup_ratio=0 still warms up for one step (at the full rate), then cosine over the other 4 to 0.
    cfg0 = TrainConfig(lr=2.0, warmup_ratio=0.0, min_lr_ratio=0.0)
    got = [lr_at(s, 5, cfg0) for s in range(6)]
    assert got == pytest.approx([2.0, 2.0, 1.0 + c, 1.0, 1.0 - c, 0.0], abs=1e-12)


def test_trainer_steps_follow_the_schedule():
    tr = _trainer()
    tr.cfg.warmup_ratio, tr.num_steps = 0.3, 4  # warm-up 2 steps, then cosine over 2
    seen = [tr.train_step(_batch(s)) for s in range(4)]
    assert seen == pytest.approx([0.5e-2, 1e-2, 1e-2, 0.5e-2])
    assert tr.opt.lr == pytest.approx(0.5e-2)


def test_gamma_reaches_the_loss_weights():
    import math

    args = DrafterArgs(**ARGS)
    torch.manual_seed(0)
    drafter, embed, head = DFlashDrafter(args), torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02

    def objective(gamma):
        return DFlashObjective(drafter, args, embed, head, DrafterConfig(block_size=8, num_anchors=8,
                               max_anchors_per_doc=4, loss_chunk_size=16, gamma=gamma))

    # Slot 0 (the given anchor token) weighs nothing; slot k >= 1 weighs exp(-(k-1)/gamma).
    for gamma, want in ((2.0, 2.0), (None, 4.0)):  # None: the default for B=8
        weights = objective(gamma).weights.tolist()
        assert weights == pytest.approx([0.0] + [math.exp(-(k - 1) / want) for k in range(1, 8)])
    hb = _batch(0)
    noise = torch.rand(2, hb.input_ids.shape[0], generator=torch.Generator().manual_seed(0))

    def loss(gamma):
        return objective(gamma)(hb.hidden, hb.input_ids, hb.position_ids, hb.doc_ids, hb.loss_mask, noise)[0]

    assert not torch.isclose(loss(2.0), loss(None))


def _rank_overlapped_steps(rank, world_size, overlap):
    """Three data-parallel steps (each rank its own batches), the all-reduce bucketed during backward or
    one collective after it."""
    import torch.distributed as dist

    args = DrafterArgs(**{**ARGS, "num_layers": 3})
    torch.manual_seed(0)
    obj = DFlashObjective(DFlashDrafter(args), args, torch.randn(128, 32) * 0.02, torch.randn(128, 32) * 0.02,
                          DrafterConfig(num_layers=3, block_size=8, num_anchors=8, max_anchors_per_doc=4,
                                        loss_chunk_size=16))
    cfg = TrainConfig(compile="eager", warmup_ratio=0.0, lr=1e-2, weight_decay=0.1, allreduce_overlap=overlap)
    tr = DrafterTrainer(obj, cfg, 10, dist.group.WORLD, torch.device("cpu"))
    torch.manual_seed(3 + rank)
    launched = []
    for step in range(3):
        tr.train_step(_batch(10 * step + rank))
        launched.append(tr.opt.reduced_in_backward)
    return tr.opt.master.clone(), tr.opt.exp_avg_sq.clone(), launched, len(tr.opt._segments)


def test_the_bucketed_all_reduce_during_backward_gives_the_same_steps():
    """2 gloo ranks: with train.allreduce_overlap the 4 buckets (the weights outside the layers, then
    one per layer) are launched from backward's gradient hooks, each once its last gradient is in (the
    layers' while backward still runs the layers before them), and the steps equal those of the one
    collective after backward, bit for bit."""
    on = run_ranks(_rank_overlapped_steps, 2, True, timeout=120)
    off = run_ranks(_rank_overlapped_steps, 2, False, timeout=120)
    (m0, v0, launched, segments), (m1, v1, _, _) = on
    # Last layer first: its sum is under way while backward computes the layers before it.
    assert segments == 4 and launched == [[3, 2, 1, 0]] * 3
    assert torch.equal(m0, m1) and torch.equal(v0, v1)  # the replicas agree
    assert torch.equal(m0, off[0][0]) and torch.equal(v0, off[0][1])
    assert off[0][2] == [[]] * 3  # without the option nothing is launched in backward
