"""The evaluator on the tiny random target: report contents, eval.json, and a loud lossless failure."""

import json

import pytest
import torch

from dflash_mp.cli import compose_tool
from dflash_mp.config import compose
from dflash_mp.evaluate import EvalConfig, main, walk_decode_path
from dflash_mp.model import anchor_candidates

DATA = ["data.max_rows=40", "data.eval_fraction=0.25", "data.seq_len=256"]
EVAL = ["eval.num_prompts=3", "eval.max_new_tokens=12", "eval.num_batches=2", "eval.num_anchors=32"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from dflash_mp.export import export_drafter
    from dflash_mp.runtime import prepare
    from dflash_mp.model import DFlashDrafter
    from dflash_mp.trainer import build_drafter_args

    d = tmp_path_factory.mktemp("evaluate")
    cache = f"target.cache_dir={d / 'cache'}"
    job = compose([cache])
    res = prepare(job)
    tcfg, layer_ids, mask = res.target_config, res.layer_ids, res.mask_token_id
    args = build_drafter_args(job.drafter, tcfg, layer_ids, mask)
    torch.manual_seed(0)
    out = export_drafter(DFlashDrafter(args), args, d / "export", tcfg)
    return out, cache


def test_report_and_eval_json(export, capsys):
    path, cache = export
    main([f"checkpoint={path}", cache, *DATA, *EVAL])
    printed = capsys.readouterr().out
    assert "tau_sim" in printed and "tau_sim_anchors" in printed and "live tau" in printed and "lossless" in printed
    report = json.load(open(path / "eval.json"))
    sim, live = report["sim"], report["live"]
    assert sim["held_out"] and sim["batches"] >= 1 and 0 < sim["blocks"] <= sim["anchors"]
    assert 1.0 <= sim["tau_sim"] <= 8.0 and 1.0 <= sim["tau_sim_anchors"] <= 8.0
    assert set(sim["acc_slot"]) == {str(k) for k in range(1, 8)}
    assert live["lossless"] and report["failures"] == [] and live["num_prompts"] == 3
    steps = sum(live["acceptance_histogram"].values())
    assert live["target_forwards"] == steps + live["num_prompts"]  # one prefill per prompt
    assert live["generated_tokens"] == sum(int(k) * n for k, n in live["acceptance_histogram"].items()) + 3
    assert 1.0 <= live["tau"] <= 8.0 and live["speedup_device"] == "cpu" and live["speedup_note"]


@pytest.mark.parametrize("setting", ["target.reduction_configs", "target.cublas_workspace"])
def test_the_target_s_process_settings_are_applied_as_in_a_run(export, setting):
    """The evaluator's process takes the job's target settings before its first GEMM and compile, as a
    run's target does: a bad value is refused, named."""
    path, cache = export
    with pytest.raises(ValueError, match=rf"{setting}='fastest': use "):
        main([f"checkpoint={path}", cache, *DATA, *EVAL, f"{setting}=fastest"])


def test_walk_decode_path_lays_blocks_like_decoding():
    # Two replies of doc 0 (positions 1-5 and 8-10), then doc 1 right after (11-14) with no gap.
    doc_ids = torch.tensor([0] * 11 + [1] * 4 + [-1])
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0])
    cand = anchor_candidates(loss_mask, doc_ids)
    accept = torch.ones(16, dtype=torch.long)
    accept[1], accept[3], accept[8], accept[11], accept[13] = 2, 4, 3, 2, 5
    # Reply 1: 1 -> 3 -> 7 (past the reply). Reply 2: 8 -> 11, where doc 1 starts: the walk stops
    # there (doc 1 is walked from its own start, once). Doc 1: 11 -> 13 -> 18 (past the end).
    assert walk_decode_path(accept, loss_mask, doc_ids, cand) == [2, 4, 3, 2, 5]


def test_not_lossless_fails_loudly(export, tmp_path, monkeypatch):
    import dflash_mp.speculative as spec

    real = spec.speculative_generate

    def corrupt(*args, **kwargs):
        out = real(*args, **kwargs)
        out.tokens[-1] += 1
        return out

    monkeypatch.setattr(spec, "speculative_generate", corrupt)
    path, cache = export
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exit_info:
        main([f"checkpoint={path}", cache, *DATA, *EVAL, "eval.num_prompts=1", f"eval.out={out}"])
    assert exit_info.value.code != 0
    report = json.load(open(out))  # written before failing, for the post-mortem
    assert not report["live"]["lossless"] and "prompt 0" in report["failures"][0]


def test_overrides_reach_the_job_config():
    job, mine = compose_tool("eval", EvalConfig,
                             ["checkpoint=x", "eval.num_prompts=4", "data.path=y", "checkpoint.resume=auto"])
    assert (mine.checkpoint, mine.num_prompts) == ("x", 4)
    assert (job.data.path, job.checkpoint.resume) == ("y", "auto")


def test_evaluate_runs_against_a_random_builtin_target(export, capsys):
    """evaluate takes a random-weight builtin target.path as the job does (same shapes as the tiny
    target the export was made for) and its live decoding stays lossless."""
    path, cache = export
    main([f"checkpoint={path}", cache, "target.path=builtin:random-tiny-qwen3", *DATA, *EVAL])
    report = json.load(open(path / "eval.json"))
    assert report["target"].endswith("random-tiny-qwen3") or "random" in report["target"]
    assert report["live"]["lossless"] and report["failures"] == []
