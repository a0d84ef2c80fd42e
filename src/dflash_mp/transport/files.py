"""Offline features: a Receiver that reads hidden states dumped by `python -m dflash_mp.dump`.

Layout of a dump directory (written by `dflash_mp.dump`):

    manifest.json                      shapes, dtype, layer ids, target, data config, shard list
    r000-00000.safetensors             one shard: `batches_per_shard` batches of dump rank 0, stacked:
    r000-00001.safetensors ...           hidden [n, T, K*H], input_ids / position_ids / doc_ids /
    r001-00000.safetensors ...           loss_mask [n, T] int64, num_valid_tokens [n] int64

Batch order is deterministic: the batches of all dump ranks interleaved round robin (batch 0 of every
rank, then batch 1, ...), the same order a streaming target group feeds them. Drafter `k` of `n`
takes position `g = step * n + k` at drafter step `step`: in the first pass over the dump, batch `g`,
so with one dump rank it sees exactly the batches a streaming job with one target rank would have
sent it; pass `p >= 1` visits the batches in a permutation seeded by (data seed, p), so later
passes do not repeat the first one's order (a dump cannot re-pack its rows as a streaming target
does each epoch). Reads run one
batch ahead on a helper thread that only touches CPU tensors; the copy into the fixed receive
buffers (stable addresses, like transport slots) happens on the caller's thread.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from dflash_mp.batch import TOKEN_FIELDS, HiddenBatch
from dflash_mp.topology import FILES_SOURCE, Topology
from dflash_mp.transport.base import BaseReceiver, SlotSpec

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def read_manifest(files_dir: str) -> dict:
    path = os.path.join(files_dir, MANIFEST)
    if not files_dir or not os.path.isfile(path):
        raise ValueError(
            f"transport.files_dir={files_dir!r} has no {MANIFEST}: point it at the dump.dir of a finished "
            "`python -m dflash_mp.dump ... dump.dir=DIR` run (a run that stopped early resumes when rerun)."
        )
    with open(path) as f:
        return json.load(f)


def batch_index(manifest: dict) -> list[tuple[str, int]]:
    """(shard file, row in the shard) of every batch, in the global deterministic order."""
    per_rank: dict[int, list[tuple[str, int]]] = {}
    for sh in sorted(manifest["shards"], key=lambda s: (s["rank"], s["index"])):
        per_rank.setdefault(sh["rank"], []).extend((sh["file"], j) for j in range(sh["num_batches"]))
    longest = max((len(v) for v in per_rank.values()), default=0)
    return [per_rank[r][i] for i in range(longest) for r in sorted(per_rank) if i < len(per_rank[r])]


class FilesReceiver(BaseReceiver):
    """`BaseReceiver` over a dump: one source (`FILES_SOURCE`), positioned by the drafter step."""

    def __init__(self, files_dir: str, topology: Topology, spec: SlotSpec, prefetch: int = 2):
        m = read_manifest(files_dir)
        if (m["seq_len"], m["hidden_dim"]) != (spec.seq_len, spec.hidden_dim):
            raise ValueError(
                f"the dump in {files_dir} holds batches of [{m['seq_len']}, {m['hidden_dim']}] (seq_len, K*H; "
                f"layers {m['layer_ids']}), but this job expects [{spec.seq_len}, {spec.hidden_dim}]: use the "
                "data.seq_len and target.layer_ids / num_capture of the dump run."
            )
        self.dir = files_dir
        self.manifest = m
        self.index = batch_index(m)
        if not self.index:
            raise ValueError(f"transport.files_dir={files_dir}: the dump holds no batches; rerun the dump "
                             "with data that yields at least one batch.")
        self.spec = spec
        self.me, self.num = topology.role_rank, topology.role_size
        self._seed = int(m.get("data", {}).get("seed", 0))
        self._perms: dict[int, list[int]] = {}
        self.step = 0
        self.wait_s, self.bytes_received = 0.0, 0
        self._last: dict[str, float] = {}
        self._handles: dict[str, object] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-files")
        self._ahead: dict[int, Future] = {}
        self._prefetch = max(1, prefetch)
        t, h = spec.seq_len, spec.hidden_dim
        # Fixed receive buffers: the drafter step always sees the same tensor objects.
        self._buf = HiddenBatch(
            hidden=torch.zeros(t, h, dtype=spec.hidden_dtype, device=spec.device),
            **{f: torch.zeros(t, dtype=torch.int64, device=spec.device) for f in TOKEN_FIELDS})

    @property
    def num_batches(self) -> int:
        return len(self.index)

    def global_batch(self, step: int) -> int:
        """The dump batch this drafter reads at `step` (see the module docstring); pure in `step`,
        so a resumed job reads what the uninterrupted one would have."""
        n = len(self.index)
        p, i = divmod(step * self.num + self.me, n)
        if p == 0:
            return i
        if p not in self._perms:
            if len(self._perms) >= 2:  # this pass and the next are all the prefetcher needs
                self._perms.pop(min(self._perms))
            self._perms[p] = np.random.default_rng([self._seed, p]).permutation(n).tolist()
        return self._perms[p][i]

    def seek(self, step: int) -> None:
        """Continue at drafter step `step` (resume)."""
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        self.step = step

    def _read(self, g: int) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        file, row = self.index[g]
        f = self._handles.get(file)
        if f is None:
            if len(self._handles) >= 4:  # a handle per recently used shard, not one per shard of the run
                self._handles.pop(next(iter(self._handles)))
            f = self._handles[file] = safe_open(os.path.join(self.dir, file), framework="pt", device="cpu")
        names = ("hidden", *TOKEN_FIELDS, "num_valid_tokens")
        return {n: f.get_slice(n)[row] for n in names}

    def _fetch(self, step: int) -> dict[str, torch.Tensor]:
        for s in range(step, step + self._prefetch + 1):
            if s not in self._ahead:
                self._ahead[s] = self._pool.submit(self._read, self.global_batch(s))
        return self._ahead.pop(step).result()

    def recv(self, src: int = FILES_SOURCE) -> HiddenBatch:
        """The next batch of this drafter's deterministic share; valid until the next recv."""
        if src != FILES_SOURCE:
            raise ValueError(f"a files transport has no target ranks (asked for rank {src}).")
        t0 = time.perf_counter()
        cpu = self._fetch(self.step)
        self.wait_s += time.perf_counter() - t0
        b = self._buf
        b.hidden.copy_(cpu["hidden"])  # casts when the dump's dtype differs (e.g. fp32 dump, bf16 run)
        for name in TOKEN_FIELDS:
            getattr(b, name).copy_(cpu[name])
        b.num_valid_tokens = int(cpu["num_valid_tokens"])
        b.seq = self.step
        self.bytes_received += sum(t.numel() * t.element_size() for t in cpu.values())
        self.step += 1
        return b

    def expect_end(self, src: int = FILES_SOURCE) -> None:
        """Files carry no end-of-data message; the manifest fixed the number of steps."""

    def verify(self) -> None:
        """Nothing to check per message: shapes were checked against the manifest."""

    def stats(self) -> dict:
        """wait_ms / bytes_received: since the previous call (the Receiver's keys)."""
        out = {"wait_ms": 1e3 * (self.wait_s - self._last.get("wait", 0.0)),
               "bytes_received": int(self.bytes_received - self._last.get("bytes", 0))}
        self._last = {"wait": self.wait_s, "bytes": float(self.bytes_received)}
        return out

    def close(self) -> None:
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        self._pool.shutdown(wait=True)
        self._handles.clear()
