"""TensorBoard scalars reduced over a role's group, and the console progress bar.

Rank-specific side effects go through null objects: every rank calls `log(...)`; only the role
leader owns a real writer and bar. `DrafterMetrics` and `TargetMetrics` own each role's interval
accumulators and FLOP model: the run loop calls `update` per step and `flush` at logging steps.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compile_stats import counts as compile_counts
from .flops import (DrafterShape, causal_pairs_packed, drafter_attention_flops, drafter_matmul_flops,
                    target_layers_flops)
from .batch import PackedBatch
from .gpu_memory import memory_scalars
from .resilience import DataTally

log = logging.getLogger(__name__)


@dataclass
class LoggingConfig:
    log_every: int = 10  # steps between metric reductions (the only host syncs of the hot loop)
    tensorboard: bool = True  # write event files under <run_dir>/tb/<role>
    progress: bool = True  # progress bar with ETA on the first drafter rank's console
    peak_tflops: float = 790.0  # MFU denominator: measured dense bf16 matmul rate of one H200
    curve_every: int = 100  # steps between acceptance-curve figures (the last step always draws one); 0: none


class NullWriter:
    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def add_text(self, *args, **kwargs) -> None:
        pass

    def add_custom_scalars(self, *args, **kwargs) -> None:
        pass

    def add_figure(self, *args, **kwargs) -> None:
        pass

    def add_row(self, *args, **kwargs) -> None:
        pass

    def acceptance(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def dashboard_layout(tags=()) -> dict:
    """TensorBoard "Custom Scalars" charts. Tags are regexes; a chart draws every run's matching tags,
    so role-split tags (drafter under tb/drafter, target under tb/target) share one chart when
    TensorBoard is pointed at `<run_dir>/tb`.

    TensorBoard colours lines by run, not by tag: a chart holds several tags of one run only where
    they are told apart without colour. So the per-slot accuracies are a figure (`AcceptanceCurve`),
    and the step phases and compile counters get one chart each. `tags`: the tags the first logging
    step wrote; charts of tags this run never writes (memory on CPU) are left out."""
    multi = lambda *tags: ["Multiline", list(tags)]  # noqa: E731
    layout = {
        "acceptance": {
            "simulated acceptance length": multi("drafter/tau_sim"),
            "loss": multi("drafter/loss"),
        },
        "throughput": {
            "tokens/s per role": multi("throughput/tokens_per_s", "target/tokens_per_s"),
            "MFU per role": multi("throughput/mfu", "target/mfu"),
            "drafter samples/s": multi("throughput/samples_per_s"),
        },
        "drafter step phases (ms, the step before each log)": {
            "forward + backward": multi("time/fwd_bwd_ms"),
            "gradient all-reduce": multi("time/allreduce_ms"),
            "optimizer": multi("time/optimizer_ms"),
            "drafter wait for hidden states": multi("comm/wait_ms"),
            "previous logging step": multi("time/logging_ms"),
        },
        "communication": {
            "drafter wait / target stall (ms)": multi("comm/wait_ms", "comm/stall_ms"),
            "batches in flight": multi("comm/in_flight"),
        },
        "compile": {
            "graphs": multi("compile/graphs"),
            "recompiles after warm-up": multi("compile/recompiles"),
            "CUDA graph recordings": multi("compile/cudagraph_records"),
        },
    }
    if any(t.startswith("memory/") for t in tags):
        layout["compile"]["memory (GiB)"] = multi(r"memory/.*")
    return layout


class AcceptanceCurve:
    """Per-slot accuracy and cumulative acceptance against the slot index, at the latest logging
    step and a few earlier ones, as one matplotlib figure (TensorBoard's Images tab).

    Cumulative acceptance at slot k is prod_{j<=k} acc_j: the chance that the first k drafted tokens
    are all accepted if the slots err independently. 1 + its sum is the expected accepted length
    under that assumption, shown next to the measured `tau_sim` (they differ by how correlated the
    slots' errors are)."""

    EARLIER = 4  # earlier steps drawn next to the latest

    def __init__(self):
        self.history: list[tuple[int, list[float], float]] = []

    def add(self, step: int, accs: list[float], tau: float) -> None:
        self.history.append((step, list(accs), float(tau)))

    def shown(self) -> list[tuple[int, list[float], float]]:
        """The latest step and up to EARLIER earlier ones, evenly spaced over the history, oldest first."""
        h = self.history
        if len(h) <= self.EARLIER + 1:
            return list(h)
        picks = sorted({round(i * (len(h) - 1) / self.EARLIER) for i in range(self.EARLIER + 1)})
        return [h[i] for i in picks]

    @staticmethod
    def cumulative(accs: list[float]) -> list[float]:
        out, p = [], 1.0
        for a in accs:
            p *= a
            out.append(p)
        return out

    def figure(self):
        import matplotlib

        matplotlib.use("Agg")  # no display on a training node
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice is no news
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 4), dpi=90)
        acc_ax, cum_ax = fig.subplots(1, 2, sharey=True)
        shown = self.shown()
        cmap = matplotlib.colormaps["viridis"]
        for i, (step, accs, tau) in enumerate(shown):
            latest = i == len(shown) - 1
            style = {"color": "black", "lw": 2.2, "marker": "o"} if latest else \
                {"color": cmap(0.15 + 0.7 * i / max(len(shown) - 1, 1)), "lw": 1.2, "marker": ".", "alpha": 0.8}
            slots = range(1, len(accs) + 1)
            cum = self.cumulative(accs)
            acc_ax.plot(slots, accs, label=f"step {step}", **style)
            cum_ax.plot(slots, cum, label=f"step {step}: tau_sim {tau:.2f}, indep. {1 + sum(cum):.2f}", **style)
        for ax, title in ((acc_ax, "accuracy per block slot"),
                          (cum_ax, "cumulative acceptance (prod of slot accuracies)")):
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("slot k (drafted position after the anchor)")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper right")
        acc_ax.set_ylabel("fraction")
        if shown:
            acc_ax.set_xticks(range(1, len(shown[-1][1]) + 1))
            cum_ax.set_xticks(range(1, len(shown[-1][1]) + 1))
        fig.tight_layout()
        return fig


class Writer:
    """TensorBoard scalars plus one JSON line per logging step (`<log_dir>/scalars.jsonl`), so
    scripts and tests read the same numbers TensorBoard shows without parsing event files.

    The drafter's writer also registers `dashboard_layout()` (once, at its first flush), so the
    Custom Scalars tab groups per-slot acceptance, per-role throughput/MFU, comm and compile charts.
    """

    def __init__(self, log_dir: str, tensorboard: bool, run_id: str | None = None, curve_every: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.tb = SummaryWriter(log_dir=log_dir) if tensorboard else NullWriter()
        self.jsonl = open(os.path.join(log_dir, "scalars.jsonl"), "a")
        self.row: dict[str, float] = {}
        self.layout_written = False
        self.run_id = run_id  # every row names its run: rows of two runs in one file stay apart
        self.curve, self.curve_every, self.curve_drawn = AcceptanceCurve(), curve_every, None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.tb.add_scalar(tag, value, step)
        self.row["step"] = step
        self.row[tag] = float(value)

    def add_row(self, tag: str, value: float, step: int) -> None:
        """scalars.jsonl only: diagnostics for scripts and tests (a data checksum), no chart."""
        self.row["step"] = step
        self.row[tag] = float(value)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.tb.add_text(tag, text, step)

    def add_figure(self, tag: str, figure, step: int) -> None:
        self.tb.add_figure(tag, figure, step, close=False)

    def acceptance(self, step: int, accs: list[float], tau: float, final: bool = False) -> None:
        """Record this logging step's slot accuracies; draw the curve figure every `curve_every`
        steps and at the last step (drawing costs tens of ms: not at every logging step)."""
        if not self.curve_every or not accs or isinstance(self.tb, NullWriter):
            return
        self.curve.add(step, accs, tau)
        due = self.curve_drawn is None or step - self.curve_drawn >= self.curve_every
        if due or final:
            self.add_figure("drafter/acceptance_curve", self.curve.figure(), step)
            self.curve_drawn = step

    def flush(self) -> None:
        if not self.layout_written and "drafter/loss" in self.row:
            self.tb.add_custom_scalars(dashboard_layout(self.row))
            self.layout_written = True
        if self.row:
            row = {"run_id": self.run_id, **self.row} if self.run_id else self.row
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
            self.row = {}
        self.tb.flush()

    def close(self) -> None:
        self.flush()
        self.jsonl.close()
        self.tb.close()


def make_writer(enabled: bool, leader: bool, log_dir: str, run_id: str | None = None, curve_every: int = 0):
    """A real writer on the role leader, a null one elsewhere."""
    return Writer(log_dir, enabled, run_id, curve_every) if leader else NullWriter()


def reduce_scalars(values: dict[str, torch.Tensor | float], group, mode: str = "mean") -> dict[str, float]:
    """Mean (or sum) of each scalar over `group` with one all-reduce; returns host floats."""
    if not values:
        return {}
    keys = sorted(values)
    device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    flat = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=device).reshape(())
                        for k in keys])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        # The group's backend decides where the numbers go: host memory for gloo, a GPU for NCCL
        # (a target's host-side floats on an NCCL target group, say).
        gloo = dist.get_backend(group) == "gloo"
        where = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
        moved = flat.to(where)
        dist.all_reduce(moved, group=group)
        flat = moved
        if mode == "mean":
            flat = flat / dist.get_world_size(group)
    return dict(zip(keys, flat.tolist()))


class _AboveBars:
    """A log handler's stream that prints above this process's tqdm bars (`tqdm.write` clears the
    bar, prints the line, redraws the bar) instead of onto the bar's line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


class _OffOtherBars:
    """A log handler's stream on a rank without bars, on a terminal: each line first erases the line
    the cursor is on, where the leader process may have drawn its bar (the bar comes back at its
    next update), so the line does not land behind the bar's text."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        self.stream.write("\r\x1b[2K" + text)

    def flush(self) -> None:
        self.stream.flush()


def quiet_console(show_bars: bool) -> None:
    """One set of progress bars per job: the drafter leader's. Elsewhere transformers' and datasets'
    bars ("Loading weights", tokenization) are off; where bars show, log lines go above them."""
    wrap = _AboveBars if show_bars else _OffOtherBars
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if type(handler) is not logging.StreamHandler or isinstance(stream, (_AboveBars, _OffOtherBars)):
            continue
        if show_bars or (hasattr(stream, "isatty") and stream.isatty()):
            handler.setStream(wrap(stream))
    if not show_bars:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if "datasets" in sys.modules:
            sys.modules["datasets"].disable_progress_bars()
        else:  # read when a rank that loads data imports it; the others never pay its import (half a second)
            os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


class Progress:
    """tqdm bar with ETA; a no-op off the leader. Log lines go above it (`quiet_console`)."""

    def __init__(self, enabled: bool, total: int, initial: int, desc: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            quiet_console(True)
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=1.0)

    def update(self, n: int, postfix: dict[str, float] | None = None) -> None:
        if self.bar is None:
            return
        if postfix:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Timer:
    """Wall time between `lap()` calls, in seconds."""

    def __init__(self):
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


class Hiccups:
    """Steps that take far longer than the usual one, warned with where their time went: after
    `min_steps` steps of the same kind, one over `factor` x their median (of the last `window`) is
    logged. Steps that log are their own kind: on a GPU the host runs ahead of the device between
    them and waits for it there, so a logging step's host time is the interval's, not a step's."""

    def __init__(self, factor: float = 5.0, window: int = 200, min_steps: int = 20):
        self.factor, self.min_steps, self.window = factor, min_steps, window
        self.times: dict[tuple, collections.deque[float]] = {}

    def check(self, step: int, total_s: float, parts: dict[str, float]) -> str | None:
        """`parts`: seconds of the step's known phases (waiting for data, logging, checkpointing);
        the rest is the training step itself. Returns the warning, if one was logged."""
        msg = None
        times = self.times.setdefault(tuple(sorted(k for k in parts if k != "waiting for data")),
                                      collections.deque(maxlen=self.window))
        if len(times) >= self.min_steps:
            median = statistics.median(times)
            if total_s > self.factor * median:
                phases = {**parts, "the training step": total_s - sum(parts.values())}
                name, spent = max(phases.items(), key=lambda kv: kv[1])
                msg = (f"step {step} took {total_s:.2f} s, {total_s / median:.1f}x the median {median:.3f} s: "
                       f"{spent:.2f} s of it {name}")
                log.warning(msg)
        times.append(total_s)
        return msg


class DrafterMetrics:
    """A drafter rank's logging interval: receive waits, what it consumed (`DataTally`), the FLOP model
    of its step, and the rows written at each logging step. `flush` is collective over `group`."""

    def __init__(self, writer, bar: Progress, group, role_size: int, args, seq_len: int, num_anchors: int,
                 peak_tflops: float, device: torch.device, start: int):
        self.writer, self.bar, self.group, self.n = writer, bar, group, role_size
        self.shape = DrafterShape.from_args(args)
        self.b = args.block_size
        self.step_flops = drafter_matmul_flops(self.shape, seq_len, num_anchors, self.b)
        self.seq_len, self.peak_flops, self.device = seq_len, peak_tflops * 1e12, device
        self.tally = DataTally(device)
        self.t0, self.wait_s, self.last, self.log_ms = time.perf_counter(), 0.0, start, None
        self.graphs_after_warmup = 0

    def mark_warm(self) -> None:
        """Graphs compiled so far are warm-up's; any later one counts as a recompile."""
        self.graphs_after_warmup = compile_counts()["graphs"]

    def recompiles(self) -> int:
        return compile_counts()["graphs"] - self.graphs_after_warmup

    def update(self, hb, wait_s: float) -> None:
        """One received batch and the host time spent waiting for it."""
        self.wait_s += wait_s
        self.tally.add(hb)

    def flush(self, step: int, trainer, lr: float, final: bool = False) -> dict[str, float]:
        """Reduce the interval over the drafters, write its rows, advance the bar; `final`: the run's
        last step (the acceptance curve is drawn there whatever `curve_every` says)."""
        tl = time.perf_counter()
        dt = tl - self.t0
        w = self.writer
        phases = trainer.phase_ms()  # before the reductions below: reads events the last step recorded
        s = trainer.stats.pop()
        s.update(self.tally.pop())  # same all-reduce
        tot = reduce_scalars(s, self.group, mode="sum")
        n, b = self.n, self.b
        steps = tot["steps"] / n  # every drafter runs the same steps
        vals = {
            "loss": tot["loss_sum"] / max(tot["steps"], 1),
            "grad_norm": tot["gnorm_sum"] / max(tot["steps"], 1),
            "tau_sim": tot["tau_sum"] / max(tot["blocks"], 1),
        }
        w.add_scalar("drafter/loss", vals["loss"], step)
        w.add_scalar("drafter/grad_norm", vals["grad_norm"], step)
        w.add_scalar("drafter/tau_sim", vals["tau_sim"], step)
        w.add_scalar("drafter/lr", lr, step)
        w.add_scalar("drafter/skipped_steps", tot["skipped"] / n, step)  # non-finite gradients, update skipped
        accs = [tot[f"slot_correct_{k}"] / max(tot[f"slot_count_{k}"], 1) for k in range(1, b)]
        for k, acc in enumerate(accs, start=1):
            w.add_scalar(f"drafter/acc_slot_{k}", acc, step)
        w.acceptance(step, accs, vals["tau_sim"], final)
        # Wall time is the slowest rank's, but all ranks are in lock-step through the all-reduce.
        samples = tot["steps"]
        vis_pairs = self.shape.num_layers * (tot["ctx_keys"] * b + tot["blocks"] * b * b)
        flops = samples * self.step_flops + drafter_attention_flops(self.shape, vis_pairs)
        w.add_scalar("throughput/samples_per_s", samples / dt, step)
        w.add_scalar("throughput/tokens_per_s", samples * self.seq_len / dt, step)
        w.add_scalar("throughput/mfu", flops / n / dt / self.peak_flops, step)
        w.add_scalar("comm/wait_ms", 1000 * self.wait_s / max(steps, 1), step)
        # Where the last step's time went (this rank; GPU time between events on CUDA), and what logging costs.
        for name, ms in phases.items():
            w.add_scalar(f"time/{name}_ms", ms, step)
        if self.log_ms is not None:
            w.add_scalar("time/logging_ms", self.log_ms, step)
        # What the drafters consumed in this interval: proves nothing lost or repeated.
        w.add_scalar("data/docs", tot["data_docs"], step)
        w.add_scalar("data/tokens", tot["data_tokens"], step)
        w.add_row("data/checksum", tot["data_checksum"], step)  # for tests and scripts: no chart
        c = compile_counts()
        w.add_scalar("compile/graphs", c["graphs"], step)
        w.add_scalar("compile/cudagraph_records", c["cudagraph_records"], step)
        w.add_scalar("compile/recompiles", c["graphs"] - self.graphs_after_warmup, step)
        for tag, gib in memory_scalars(self.device).items():
            w.add_scalar(tag, gib, step)
        w.flush()
        self.bar.update(step - self.last, {"loss": vals["loss"], "tau": vals["tau_sim"]})
        self.t0, self.wait_s, self.last = time.perf_counter(), 0.0, step
        self.log_ms = 1000 * (self.t0 - tl)  # host time this logging step took, logged with the next
        return vals


class TargetMetrics:
    """A target rank's logging interval: tokens, documents and forward FLOPs sent, and the rows
    written at each logging step. `flush` is collective over `group`."""

    def __init__(self, writer, group, role_size: int, config: dict, layers: range, peak_tflops: float,
                 device: torch.device, skipped: dict[str, int], start: int):
        self.writer, self.group, self.n = writer, group, role_size
        self.config, self.layers = config, layers  # the target's config.json fields; the layers this rank runs
        self.peak_flops, self.device, self.skipped = peak_tflops * 1e12, device, skipped
        self.t0, self.tokens, self.flops, self.docs, self.last = time.perf_counter(), 0, 0.0, 0, start
        self._pairs = None  # a later stage's attention pairs, summed on the device (no sync per batch)
        self._rows = 0

    def update(self, batch, data: bool = True) -> None:
        """One batch forwarded and sent: a PackedBatch (host tensors), or on a stage after the first
        the previous stage's HiddenBatch (device tensors). `data`: count its tokens and documents
        (a replica's first stage does; the others count only the FLOPs of their own layers)."""
        if isinstance(batch, PackedBatch):
            if data:
                self.tokens += batch.num_valid_tokens
                self.docs += batch.num_docs
            pairs = causal_pairs_packed(torch.bincount(batch.doc_ids[batch.doc_ids >= 0]).tolist())
            self.flops += target_layers_flops(self.config, self.layers, batch.seq_len, pairs)
            return
        docs = batch.doc_ids
        counts = torch.zeros(docs.shape[0] + 1, dtype=torch.float64, device=docs.device)
        counts.index_add_(0, docs + 1, torch.ones_like(docs, dtype=torch.float64))
        pairs = (counts[1:] * (counts[1:] + 1) / 2).sum()  # slot 0: padding (doc id -1)
        self._pairs = pairs if self._pairs is None else self._pairs + pairs
        self._rows += 1
        self.seq_len = docs.shape[0]

    def _device_flops(self) -> float:
        if self._pairs is None:
            return 0.0
        pairs, rows = float(self._pairs), self._rows  # a sync, at the flush only
        self._pairs, self._rows = None, 0
        # Linear in the pairs (but for a sliding window's cap): rows of the mean row's pairs.
        return rows * target_layers_flops(self.config, self.layers, self.seq_len, pairs / rows)

    def flush(self, step: int, sender_stats: dict) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.t0
        self.flops += self._device_flops()
        st, w, n = sender_stats, self.writer, self.n
        vals = reduce_scalars({"tokens_per_s": self.tokens / dt, "mfu": self.flops / dt / self.peak_flops,
                               # a staged target's later stages: waiting for the previous stage
                               "stage_wait_ms": st.get("wait_ms", 0.0) / (step - self.last),
                               # per step, like the drafter's comm/wait_ms
                               "stall_ms": st.get("stall_ms", 0.0) / (step - self.last),
                               "in_flight": st.get("in_flight", 0),
                               "docs": self.docs, "tokens": self.tokens}, self.group)
        # Rows and documents sent in this interval (all targets), and the rows the data set
        # skipped, by reason (every target tokenizes the whole set: the counts agree).
        w.add_scalar("data/docs", round(vals["docs"] * n), step)
        w.add_scalar("data/tokens", round(vals["tokens"] * n), step)
        for reason, k in sorted(self.skipped.items()):
            w.add_scalar(f"data/skipped_{reason}", k, step)
        w.add_scalar("target/tokens_per_s", vals["tokens_per_s"] * n, step)
        w.add_scalar("target/mfu", vals["mfu"], step)
        w.add_scalar("comm/stall_ms", vals["stall_ms"], step)
        w.add_scalar("comm/in_flight", vals["in_flight"], step)
        if "wait_ms" in st or vals["stage_wait_ms"]:
            w.add_scalar("comm/stage_wait_ms", vals["stage_wait_ms"], step)
        for tag, gib in memory_scalars(self.device).items():
            w.add_scalar(tag, gib, step)
        w.flush()
        self.t0, self.tokens, self.flops, self.docs, self.last = time.perf_counter(), 0, 0.0, 0, step
