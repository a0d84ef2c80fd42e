import json
import os

import pytest
import torch

from dflash_mp import checkpoint as ckpt


def write(root, step, keep=2, finish=True):
    tmp = ckpt.tmp_dir(root, step)
    os.makedirs(tmp, exist_ok=True)
    ckpt.save_file({"w": torch.full((3,), float(step))}, os.path.join(tmp, "drafter.pt"))
    if finish:
        return ckpt.commit(root, step, {"num_steps": 100}, keep)
    return tmp


def test_commit_renames_and_manifest_lists_files(tmp_path):
    path = write(str(tmp_path), 5)
    m = ckpt.read_manifest(path)
    assert m["step"] == 5 and m["files"] == ["drafter.pt"] and m["num_steps"] == 100
    assert ckpt.load_file(path, "drafter.pt")["w"].tolist() == [5.0, 5.0, 5.0]


def test_interrupted_write_leaves_previous_newest(tmp_path):
    root = str(tmp_path)
    write(root, 10)
    write(root, 20, finish=False)  # killed before the manifest: never visible
    assert ckpt.resolve_resume("auto", root).endswith("step_00000010")


def test_prune_keeps_newest(tmp_path):
    root = str(tmp_path)
    for s in (1, 2, 3, 4):
        write(root, s, keep=2)
    names = sorted(os.listdir(root))
    assert names == ["step_00000003", "step_00000004"]


def test_auto_with_nothing_is_fresh_start(tmp_path):
    assert ckpt.resolve_resume("auto", str(tmp_path / "none")) is None
    assert ckpt.resolve_resume("", str(tmp_path)) is None


def test_missing_and_corrupt_checkpoints_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.resolve_resume(str(tmp_path / "nope"), str(tmp_path))
    path = write(str(tmp_path), 7)
    with open(os.path.join(path, "drafter.pt"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match="cannot be loaded"):
        ckpt.load_file(path, "drafter.pt")
    with open(os.path.join(path, ckpt.MANIFEST), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        ckpt.resolve_resume(path, str(tmp_path))
    # auto skips the corrupt one
    assert ckpt.resolve_resume("auto", str(tmp_path)) is None


def test_manifest_listing_a_missing_file_is_incomplete(tmp_path):
    path = write(str(tmp_path), 3)
    m = json.load(open(os.path.join(path, ckpt.MANIFEST)))
    m["files"].append("rng_rank1.pt")
    json.dump(m, open(os.path.join(path, ckpt.MANIFEST), "w"))
    with pytest.raises(ValueError, match="missing"):
        ckpt.read_manifest(path)
