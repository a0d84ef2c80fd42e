"""What a user reads: the event files of a real short run against README's Dashboards section, and
the console of the drafter leader."""

import io
import logging
import os
import re
import struct
import subprocess
import sys

import pytest

from dflash_mp.metrics import AcceptanceCurve, Progress, dashboard_layout

from e2e_utils import SMALL, scalars, torchrun

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
NOT_A_TAG = {"custom_scalars__config__"}  # the Custom Scalars layout itself


def readme_tag_patterns() -> list[re.Pattern]:
    """The first cell of each row of the Dashboards table, `{placeholder}` matching one word."""
    text = open(README).read()
    section = text[text.index("## Dashboards"):]
    section = section[:section.find("\n## ", 3)] if "\n## " in section[3:] else section
    cells = re.findall(r"^\| `([^`]+)` \|", section, re.MULTILINE)
    assert cells, "README's Dashboards section lists no tags"
    return [re.compile(re.sub(r"\\\{\w+\\\}", r"\\w+", re.escape(c))) for c in cells]


def event_tags(acc) -> set[str]:
    tags = acc.Tags()
    out = set(tags["scalars"]) | set(tags["images"]) | set(tags["histograms"])
    # add_text stores "<tag>/text_summary" tensors
    out |= {t.removesuffix("/text_summary") for t in tags["tensors"]}
    return out - NOT_A_TAG


def load(run_dir: str, role: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tb", role),
                           size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def text(acc, tag: str) -> str:
    return acc.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_event_files_hold_the_curve_the_resolved_choices_and_only_documented_tags(tmp_path):
    run_dir = str(tmp_path / "run")
    # The default job with its own choices (compile, progress bar) left to the run, few steps.
    ov = [o for o in SMALL if not o.startswith(("train.compile=", "logging.progress="))]
    proc = torchrun(3, ov + [f"run_dir={run_dir}", "train.max_steps=5", "logging.curve_every=2"])

    drafter, target = load(run_dir, "drafter"), load(run_dir, "target")

    # The acceptance curve: drawn at the first logged step, every curve_every steps, and the last.
    images = drafter.Images("drafter/acceptance_curve")
    assert [i.step for i in images] == [1, 3, 5]
    w, h = png_size(images[-1].encoded_image_string)
    assert w > 300 and h > 150
    # The per-slot scalars stay, one tag per slot.
    tags = event_tags(drafter)
    assert {f"drafter/acc_slot_{k}" for k in range(1, 8)} <= tags

    # What the run chose, next to the config that says auto.
    assert "compile: auto" in text(drafter, "config")
    resolved = text(drafter, "resolved")
    assert "| drafter compile mode | eager (layers scope) |" in resolved
    assert "| drafter precision (weights) | fp32 |" in resolved
    assert "| loss kernel | eager |" in resolved
    assert "drafters gloo" in resolved and "targets gloo" in resolved
    assert "| transport per pair (target->drafter) | 0->1 shm, 0->2 shm |" in resolved
    assert "| hidden-state dtype | float32 |" in resolved
    assert "| target head dim | 32 |" in resolved
    assert "| target attention implementation | sdpa with the dense packed-document mask |" in text(target, "resolved")
    # ... and the console said the same.
    assert "drafter step: compile eager (layers scope), fp32 weights, loss kernel eager" in proc.stderr

    # Every tag of both runs is in README's table; diagnostics stay out of the charts.
    patterns = readme_tag_patterns()
    all_tags = tags | event_tags(target)
    undocumented = sorted(t for t in all_tags if not any(p.fullmatch(t) for p in patterns))
    assert not undocumented, f"tags missing from README's Dashboards section: {undocumented}"
    assert "data/checksum" not in all_tags
    assert all("data/checksum" in r for r in scalars(run_dir) if "data/docs" in r)  # the tests' copy

    # Custom Scalars: no chart of tags this run never writes (memory on CPU), none of several slots.
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout()
    layout.ParseFromString(drafter.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = [c for cat in layout.category for c in cat.chart]
    assert not [c.title for c in charts if "memory" in c.title]
    for c in charts:
        for tag_re in c.multiline.tag:
            assert any(re.fullmatch(tag_re, t) for t in all_tags), (c.title, tag_re)

    # One bar per job, the drafter leader's: the target's weight loading and tokenization draw none
    # (where the leader's log lines go: the unit tests below).
    assert "drafter:   0%" in proc.stderr
    assert "Loading weights" not in proc.stderr and "tokenize:" not in proc.stderr


def test_layout_leaves_out_memory_without_memory_tags():
    assert "memory (GiB)" not in dashboard_layout({"drafter/loss": 1.0})["compile"]
    assert "memory (GiB)" in dashboard_layout({"drafter/loss": 1.0, "memory/max_reserved_gib": 2.0})["compile"]


def test_acceptance_curve_shows_latest_and_a_few_earlier_steps():
    curve = AcceptanceCurve()
    for step in range(10, 110, 10):
        curve.add(step, [0.8, 0.5, 0.25], 1.5)
    shown = [s for s, _, _ in curve.shown()]
    assert shown[-1] == 100 and shown[0] == 10 and len(shown) == AcceptanceCurve.EARLIER + 1
    assert AcceptanceCurve.cumulative([0.8, 0.5, 0.25]) == pytest.approx([0.8, 0.4, 0.1])
    curve.figure()  # draws without a display


def test_log_lines_print_above_the_progress_bar(monkeypatch):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    from tqdm import tqdm

    monkeypatch.setattr(tqdm, "__init__", _bar_on(tqdm.__init__, stream))
    bar = Progress(True, total=10, initial=0, desc="drafter")
    bar.update(1)
    bar.bar.refresh()
    logging.getLogger("dflash_mp.test").warning("a log line")
    bar.close()
    out = stream.getvalue()
    i = out.index("a log line")
    # tqdm.write clears the bar's line first: the line starts a line of its own
    assert out[i - 1] in "\r\n", repr(out[max(0, i - 80):i + 20])


def test_ranks_without_the_bar_turn_library_bars_off_and_clear_the_bar_line(tmp_path):
    # A fresh interpreter: the switches are process-global.
    code = """
import io, logging
from dflash_mp.metrics import quiet_console
class Tty(io.StringIO):
    def isatty(self):
        return True
tty = Tty()
logging.getLogger().handlers = [logging.StreamHandler(tty)]
quiet_console(False)
logging.getLogger("x").warning("a line")
from transformers.utils import logging as hf
import datasets
print(hf.is_progress_bar_enabled(), datasets.is_progress_bar_enabled(), repr(tty.getvalue()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert out.strip() == "False False '\\r\\x1b[2Ka line\\n'", out


def _bar_on(init, stream):
    def wrapped(self, *args, **kwargs):
        kwargs["file"] = stream
        return init(self, *args, **kwargs)
    return wrapped


def test_a_step_far_slower_than_its_kind_is_warned_with_where_its_time_went(caplog):
    """After 20 steps, one over 5x the median of its kind is logged naming its largest phase; 4x
    is not; logging steps are measured against logging steps (on a GPU they absorb the interval)."""
    import logging

    from dflash_mp.metrics import Hiccups

    h = Hiccups()
    with caplog.at_level(logging.WARNING, logger="dflash_mp.metrics"):
        for step in range(40):
            logs = step % 10 == 9
            parts = {"waiting for data": 0.01, **({"logging": 0.9} if logs else {})}
            assert h.check(step, 1.0 if logs else 0.1, parts) is None  # a logging step: its kind's usual
        assert h.check(40, 0.4, {"waiting for data": 0.3}) is None
        msg = h.check(41, 0.6, {"waiting for data": 0.5})
    assert msg == "step 41 took 0.60 s, 6.0x the median 0.100 s: 0.50 s of it waiting for data"
    assert h.check(42, 0.55, {"waiting for data": 0.01}).endswith("0.54 s of it the training step")
    assert caplog.text.count("x the median") == 2
