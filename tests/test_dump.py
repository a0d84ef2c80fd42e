"""Offline features: dump the target's hidden states, then train drafter-only jobs from the files."""

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from dflash_mp.batch import HiddenBatch
from dflash_mp.cli import compose_tool
from dflash_mp.config import compose
from dflash_mp.dump import (DumpConfig, bytes_per_token, check_disk, check_options, run_dump, shard_name,
                            shard_plan, write_shard)
from dflash_mp.topology import FILES_SOURCE, Topology
from dflash_mp.transport import SlotSpec, TransportConfig, build_transport, pair_kinds
from dflash_mp.transport.files import FilesReceiver, batch_index

from e2e_utils import SMALL, losses, torchrun

T, H = 16, 6


def fake_batch(i: int) -> HiddenBatch:
    return HiddenBatch(hidden=torch.full((T, H), float(i)), input_ids=torch.full((T,), i),
                       position_ids=torch.arange(T), doc_ids=torch.zeros(T, dtype=torch.long),
                       loss_mask=torch.ones(T, dtype=torch.long), num_valid_tokens=T - i % 3)


def fake_dump(d, per_rank: list[int], per_shard: int = 3) -> None:
    """Batch j of dump rank r holds the value 100*r + j everywhere."""
    shards = []
    for r, n in enumerate(per_rank):
        for i, (first, k) in enumerate(shard_plan(n, per_shard)):
            write_shard(str(d / shard_name(r, i)), [fake_batch(100 * r + first + j) for j in range(k)],
                        torch.float32, {})
            shards.append({"file": shard_name(r, i), "rank": r, "index": i, "num_batches": k})
    manifest = {"seq_len": T, "hidden_dim": H, "layer_ids": [1], "num_batches": sum(per_rank), "shards": shards}
    (d / "manifest.json").write_text(json.dumps(manifest))


def test_shard_plan_and_bytes_per_token():
    assert shard_plan(7, 3) == [(0, 3), (3, 3), (6, 1)]
    assert shard_plan(0, 3) == []
    # Qwen3-8B, K=5, bf16: 5*4096*2 hidden bytes + 4 int64 token fields.
    assert bytes_per_token(5 * 4096, torch.bfloat16) == 40960 + 32


def test_command_line_splits_dump_options():
    argv = ["dump.dir=/x", "dump.batches_per_shard=5", "data.seq_len=64"]
    job, cfg = compose_tool("dump", DumpConfig, argv)
    assert (cfg.dir, cfg.batches_per_shard, job.data.seq_len) == ("/x", 5, 64)
    with pytest.raises(ValueError, match="dump.dir"):
        check_options(compose_tool("dump", DumpConfig, ["data.seq_len=64"])[1])
    with pytest.raises(ValueError, match="dump.batches_per_shard"):
        compose_tool("dump", DumpConfig, ["dump.dir=/x", "dump.bogus=1"])


def test_disk_warning(tmp_path, monkeypatch, caplog):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 90, 10))
    with caplog.at_level(logging.WARNING):
        assert not check_disk(str(tmp_path), 11)
    assert "free" in caplog.text
    assert check_disk(str(tmp_path), 10)


def test_global_order_interleaves_dump_ranks(tmp_path):
    fake_dump(tmp_path, [4, 3])
    m = json.loads((tmp_path / "manifest.json").read_text())
    order = batch_index(m)
    # batch 0 of rank 0, batch 0 of rank 1, batch 1 of rank 0, ...
    assert order[:3] == [("r000-00000.safetensors", 0), ("r001-00000.safetensors", 0), ("r000-00000.safetensors", 1)]
    assert order[-1] == ("r000-00001.safetensors", 0) and len(order) == 7


def test_files_receiver_shards_batches_over_drafters_and_seeks(tmp_path):
    fake_dump(tmp_path, [5])
    spec = SlotSpec(T, H, torch.float32, "cpu")
    seen = {}
    for rank in (0, 1):
        topo = Topology.plan(0, rank, 2, allow_no_target=True)
        assert topo.source_for_step(rank, 3) == FILES_SOURCE and topo.sources[rank] == ()
        cfg = TransportConfig(kind="files", files_dir=str(tmp_path))
        with build_transport(cfg, topo, spec) as rx:
            assert isinstance(rx, FilesReceiver)
            got = [int(rx.recv(FILES_SOURCE).input_ids[0]) for _ in range(4)]
            first = rx.recv(FILES_SOURCE)
            assert first.hidden.data_ptr() == rx.recv(FILES_SOURCE).hidden.data_ptr()  # fixed buffers
            rx.seek(1)
            assert int(rx.recv().input_ids[0]) == got[1]
            assert rx.stats()["bytes_received"] > 0
            rx.expect_end(FILES_SOURCE)
            rx.verify()
        seen[rank] = got
    # First pass: step s, drafter k takes batch 2s + k (0..4); the second pass is shuffled.
    assert seen[0][:3] == [0, 2, 4] and seen[1][:2] == [1, 3]
    second = [seen[1][2], seen[0][3], seen[1][3]]  # positions 5, 6, 7: the start of the second pass
    assert len(set(second)) == 3 and set(second) <= set(range(5))


def test_files_receiver_visits_every_batch_once_per_pass_in_a_new_order(tmp_path):
    fake_dump(tmp_path, [7])
    spec = SlotSpec(T, H, torch.float32, "cpu")
    topo = Topology.plan(0, 0, 1, allow_no_target=True)
    with build_transport(TransportConfig(kind="files", files_dir=str(tmp_path)), topo, spec) as rx:
        order = [int(rx.recv().input_ids[0]) for _ in range(4 * 7)]
        passes = [order[i:i + 7] for i in range(0, 28, 7)]
        assert passes[0] == list(range(7))  # the streaming order
        assert all(sorted(p) == list(range(7)) for p in passes)  # each batch once per pass
        assert len({tuple(p) for p in passes}) == 4  # and every pass in its own order
        rx.seek(9)  # resuming mid-pass reads what the uninterrupted run read
        assert [int(rx.recv().input_ids[0]) for _ in range(10)] == order[9:19]


def test_files_kind_needs_a_drafter_only_job(tmp_path):
    fake_dump(tmp_path, [2])
    with pytest.raises(ValueError, match="num_target_ranks=0"):
        pair_kinds(TransportConfig(kind="files", files_dir=str(tmp_path)), Topology.plan(1, 0, 2))
    with pytest.raises(ValueError, match="kind=files"):
        pair_kinds(TransportConfig(kind="auto"), Topology.plan(0, 0, 2, allow_no_target=True))
    with pytest.raises(ValueError, match="transport.kind=files"):
        Topology.plan(0, 0, 2)
    one = Topology.plan(0, 0, 1, allow_no_target=True)  # one process is a valid drafter-only job
    with pytest.raises(ValueError, match="data.seq_len"):
        FilesReceiver(str(tmp_path), one, SlotSpec(T + 1, H, torch.float32, "cpu"))
    with pytest.raises(ValueError, match="manifest.json"):
        FilesReceiver(str(tmp_path / "nope"), one, SlotSpec(T, H, torch.float32, "cpu"))


@pytest.mark.slow
def test_dump_then_train_from_files_equals_streaming(tmp_path, monkeypatch):
    from dflash_mp.reference import reference_run

    # The dump on the CPU on any host, as the job (e2e_utils.torchrun) and the reference: on a GPU host it
    # would pick the GPU and write bf16 features.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    feats = tmp_path / "feats"
    cfg = DumpConfig(dir=str(feats), batches_per_shard=3, max_batches=8)
    m = run_dump(compose(SMALL), cfg)
    assert m["num_batches"] == 8 and len(m["shards"]) == 3
    assert m["bytes_per_token"] == m["hidden_dim"] * 4 + 32  # fp32 on CPU
    assert set(m) >= {"layer_ids", "target_path", "data", "hidden_dtype", "seq_len"}

    # Resumable: complete shards are kept as they are, a missing one is rewritten identically.
    keep = feats / shard_name(0, 0)
    gone = feats / shard_name(0, 2)
    mtime, data = keep.stat().st_mtime_ns, load_file(gone)
    gone.unlink()
    run_dump(compose(SMALL), cfg)
    assert keep.stat().st_mtime_ns == mtime
    again = load_file(gone)
    assert set(again) == set(data) and all(torch.equal(again[k], data[k]) for k in data)
    assert not list(feats.glob("*.tmp"))

    run_dir = str(tmp_path / "run")
    ov = SMALL + [f"run_dir={run_dir}", "train.max_steps=4"]
    files = ["topology.num_target_ranks=0", "transport.kind=files", f"transport.files_dir={feats}"]
    torchrun(2, ov + files)
    assert os.path.exists(f"{run_dir}/export/model.safetensors")
    got = losses(run_dir)
    # The same batches, seeds and steps as a streaming job with one target and two drafters.
    ref = reference_run(compose(ov + ["topology.num_target_ranks=1"]), 3)
    assert sorted(got) == [1, 2, 3, 4]
    for step, want in enumerate(ref["losses"], start=1):
        assert abs(got[step] - want) <= 1e-5 * abs(want), (step, got[step], want)


def test_a_dump_forwarding_two_rows_at_a_time_writes_what_one_at_a_time_does(tmp_path):
    """target.rows_per_forward=2 over shards of 3 and 2 rows: a shard's odd last row runs with itself
    repeated (one shape for every forward) and is written once."""
    cfg = dict(batches_per_shard=3, max_batches=5)
    one = run_dump(compose(SMALL), DumpConfig(dir=str(tmp_path / "one"), **cfg))
    two = run_dump(compose(SMALL + ["target.rows_per_forward=2"]),
                   DumpConfig(dir=str(tmp_path / "two"), **cfg))
    assert one["num_batches"] == two["num_batches"] == 5
    for shard in one["shards"]:
        a, b = load_file(tmp_path / "one" / shard["file"]), load_file(tmp_path / "two" / shard["file"])
        assert set(a) == set(b)
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-5, msg=k)
