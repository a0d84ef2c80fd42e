"""The evaluator on the tiny random target: report contents, eval.json, and a loud lossless failure."""

import json

import pytest
import torch

from dflash_mp.config import compose
from dflash_mp.evaluate import EvalConfig, main
from dflash_mp.regenerate import split_overrides

DATA = ["data.max_rows=40", "data.eval_fraction=0.25", "data.seq_len=256"]
EVAL = ["eval.num_prompts=3", "eval.max_new_tokens=12", "eval.num_batches=2", "eval.num_anchors=32"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from dflash_mp.export import export_drafter
    from dflash_mp.main import prepare
    from dflash_mp.model import DFlashDrafter
    from dflash_mp.trainer import build_drafter_args

    d = tmp_path_factory.mktemp("evaluate")
    cache = f"target.cache_dir={d / 'cache'}"
    job = compose([cache])
    _, _, tcfg, layer_ids, mask = prepare(job)
    args = build_drafter_args(job.drafter, tcfg, layer_ids, mask)
    torch.manual_seed(0)
    out = export_drafter(DFlashDrafter(args), args, d / "export", tcfg)
    return out, cache


def test_report_and_eval_json(export, capsys):
    path, cache = export
    main([f"checkpoint={path}", cache, *DATA, *EVAL])
    printed = capsys.readouterr().out
    assert "tau_sim" in printed and "live tau" in printed and "lossless" in printed
    report = json.load(open(path / "eval.json"))
    sim, live = report["sim"], report["live"]
    assert sim["held_out"] and sim["batches"] >= 1 and sim["blocks"] > 0
    assert 1.0 <= sim["tau_sim"] <= 8.0 and set(sim["acc_slot"]) == {str(k) for k in range(1, 8)}
    assert live["lossless"] and report["failures"] == [] and live["num_prompts"] == 3
    steps = sum(live["acceptance_histogram"].values())
    assert live["target_forwards"] == steps + live["num_prompts"]  # one prefill per prompt
    assert live["generated_tokens"] == sum(int(k) * n for k, n in live["acceptance_histogram"].items()) + 3
    assert 1.0 <= live["tau"] <= 8.0 and live["speedup_device"] == "cpu" and live["speedup_note"]


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
    mine, rest = split_overrides(["checkpoint=x", "eval.num_prompts=4", "data.path=y", "checkpoint.resume=auto"],
                                 EvalConfig)
    assert mine == {"checkpoint": "x", "num_prompts": "4"}
    assert rest == ["data.path=y", "checkpoint.resume=auto"]
