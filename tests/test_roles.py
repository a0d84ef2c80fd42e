"""The role runs as objects: a frozen RunContext, and a run that releases what it built when
building fails half way (one real process on gloo, reading dumped features)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_mp.roles import RunContext


def test_run_context_is_frozen():
    ctx = RunContext(None, None, torch.device("cpu"), "p", {"hidden_size": 4}, [0], 1, None, torch.float32)
    assert ctx.live is None and ctx.stop is None and ctx.run_id is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.run_id = "late"


def _drafter_run_fails_late(rank, world, overrides):
    import datetime

    from dflash_mp import roles
    from dflash_mp.config import compose
    from dflash_mp.runtime import prepare
    from dflash_mp.topology import Topology
    from dflash_mp.transport.files import FilesReceiver

    job = compose(overrides)
    topo = Topology.plan(0, rank, world, allow_no_target=True)
    topo.init_groups("gloo", datetime.timedelta(seconds=60))
    res = prepare(job)
    ctx = RunContext(res.job, topo, torch.device("cpu"), res.target_path, res.target_config, res.layer_ids,
                     res.mask_token_id, res.tokenizer, torch.float32)
    closed = []
    close = FilesReceiver.close
    FilesReceiver.close = lambda self: (closed.append(True), close(self))[1]

    def fail(*args, **kwargs):  # the last part DrafterRun builds: everything else is open by now
        raise RuntimeError("late part failed")

    roles.StopAgreement = fail
    try:
        roles.DrafterRun(ctx)
    except RuntimeError as e:
        return {"error": str(e), "closed": len(closed)}
    return {"error": None, "closed": len(closed)}


def test_drafter_run_closes_its_parts_when_building_fails(tmp_path):
    from dflash_mp.config import compose
    from dflash_mp.dump import DumpConfig, run_dump

    from dist_utils import run_ranks
    from e2e_utils import SMALL

    feats = tmp_path / "feats"
    run_dump(compose(SMALL), DumpConfig(dir=str(feats), batches_per_shard=4, max_batches=4))
    ov = SMALL + [f"run_dir={tmp_path / 'run'}", "train.max_steps=2", "topology.num_target_ranks=0",
                  "transport.kind=files", f"transport.files_dir={feats}"]
    (out,) = run_ranks(_drafter_run_fails_late, 1, ov, timeout=120)
    assert out == {"error": "late part failed", "closed": 1}
