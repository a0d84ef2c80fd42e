"""TensorBoard scalars reduced over a role's group, and the console progress bar.

Rank-specific side effects go through null objects: every rank calls `log(...)`; only the role
leader owns a real writer and bar.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class LoggingConfig:
    log_every: int = 10  # steps between metric reductions (the only host syncs of the hot loop)
    tensorboard: bool = True  # write event files under <run_dir>/tb/<role>
    progress: bool = True  # progress bar with ETA on the first drafter rank's console
    peak_tflops: float = 790.0  # MFU denominator: measured dense bf16 matmul rate of one H200


class NullWriter:
    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def add_text(self, *args, **kwargs) -> None:
        pass

    def add_custom_scalars(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def dashboard_layout() -> dict:
    """TensorBoard "Custom Scalars" charts. Tags are regexes; a chart draws every run's matching tags,
    so role-split tags (drafter under tb/drafter, target under tb/target) share one chart when
    TensorBoard is pointed at `<run_dir>/tb`."""
    multi = lambda *tags: ["Multiline", list(tags)]  # noqa: E731
    return {
        "acceptance": {
            "accuracy per block slot": multi(r"drafter/acc_slot_\d+"),
            "simulated acceptance length": multi("drafter/tau_sim"),
            "loss": multi("drafter/loss"),
        },
        "throughput": {
            "tokens/s per role": multi("throughput/tokens_per_s", "target/tokens_per_s"),
            "MFU per role": multi("throughput/mfu", "target/mfu"),
            "drafter samples/s": multi("throughput/samples_per_s"),
            "drafter step phases and logging (ms)": multi(r"time/.*", "comm/wait_ms"),
        },
        "communication": {
            "drafter wait / target stall (ms)": multi("comm/wait_ms", "comm/stall_ms"),
            "batches in flight": multi("comm/in_flight"),
        },
        "compile": {
            "graphs, recompiles, CUDA graph recordings": multi(r"compile/.*"),
            "memory (GiB)": multi(r"memory/.*"),
        },
    }


class Writer:
    """TensorBoard scalars plus one JSON line per logging step (`<log_dir>/scalars.jsonl`), so
    scripts and tests read the same numbers TensorBoard shows without parsing event files.

    The drafter's writer also registers `dashboard_layout()` (once, at its first flush), so the
    Custom Scalars tab groups per-slot acceptance, per-role throughput/MFU, comm and compile charts.
    """

    def __init__(self, log_dir: str, tensorboard: bool, run_id: str | None = None):
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.tb = SummaryWriter(log_dir=log_dir) if tensorboard else NullWriter()
        self.jsonl = open(os.path.join(log_dir, "scalars.jsonl"), "a")
        self.row: dict[str, float] = {}
        self.layout_written = False
        self.run_id = run_id  # every row names its run: rows of two runs in one file stay apart

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.tb.add_scalar(tag, value, step)
        self.row["step"] = step
        self.row[tag] = float(value)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.tb.add_text(tag, text, step)

    def flush(self) -> None:
        if not self.layout_written and "drafter/loss" in self.row:
            self.tb.add_custom_scalars(dashboard_layout())
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


def make_writer(enabled: bool, leader: bool, log_dir: str, run_id: str | None = None):
    """A real writer on the role leader, a null one elsewhere."""
    return Writer(log_dir, enabled, run_id) if leader else NullWriter()


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


class Progress:
    """tqdm bar with ETA; a no-op off the leader."""

    def __init__(self, enabled: bool, total: int, initial: int, desc: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm

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
