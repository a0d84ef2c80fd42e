"""Export layout, round trip, and loading with the public DFlash inference code."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from dflash_mp.export import args_from_config, export_drafter, load_exported
from dflash_mp.model import DFlashDrafter, DrafterArgs, build_blocks

from drafter_utils import tiny_args as shared_tiny_args  # noqa: E402

H, K, V, B = 32, 3, 80, 4
MASK_ID = 79


def tiny_args(**overrides) -> DrafterArgs:
    return shared_tiny_args(**{"vocab_size": V, "target_layer_ids": [1, 4, 6], "block_size": B, **overrides})


def trained_like(args: DrafterArgs) -> DFlashDrafter:
    """A drafter whose weights are all non-trivial (norms off 1.0), as after training."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(args)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return drafter.eval()


def expected_keys(num_layers: int) -> set[str]:
    keys = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        keys |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        keys |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        keys |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return keys


def test_exact_key_set(tmp_path):
    args = tiny_args(num_layers=3)
    drafter = trained_like(args)
    assert set(drafter.state_dict()) == expected_keys(3)
    out = export_drafter(drafter, args, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected_keys(3)
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
        assert f.metadata() == {"format": "pt"}


def test_config_fields(tmp_path):
    args = tiny_args(layer_types=["full_attention", "sliding_attention"], sliding_window=5)
    target = {"num_hidden_layers": 8, "hidden_size": H, "vocab_size": V}
    out = export_drafter(trained_like(args), args, tmp_path / "e", target_config=target,
                         chat_template_kwargs={"enable_thinking": False})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["num_hidden_layers"] == 2 and config["num_key_value_heads"] == 2
    assert config["head_dim"] == 8 and config["vocab_size"] == V and config["hidden_act"] == "silu"
    assert config["attention_bias"] is False and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "bfloat16" and config["block_size"] == B
    assert config["layer_types"] == ["full_attention", "sliding_attention"]
    assert config["sliding_window"] == 5 and config["use_sliding_window"] is True
    assert config["dflash_config"] == {"target_layer_ids": [1, 4, 6], "mask_token_id": MASK_ID,
                                       "chat_template_kwargs": {"enable_thinking": False}}
    # The public meaning of num_target_layers is the target's depth.
    assert config["num_target_layers"] == 8
    assert args_from_config(config) == args


def test_target_config_mismatch_is_rejected(tmp_path):
    args = tiny_args()
    with pytest.raises(ValueError, match="hidden_size"):
        export_drafter(trained_like(args), args, tmp_path / "e", target_config={"hidden_size": H * 2})
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(tmp_path, dtype):
    args = tiny_args(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=7,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512},
    )
    drafter = trained_like(args)
    out = export_drafter(drafter, args, tmp_path / "e", dtype=dtype)
    loaded, loaded_args = load_exported(out)
    assert loaded_args == args
    for name, tensor in drafter.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == dtype
        assert torch.equal(got, tensor.to(dtype)), name
    torch.testing.assert_close(loaded.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq, atol=0, rtol=0)


def test_export_replaces_atomically(tmp_path):
    args = tiny_args()
    target = tmp_path / "export"
    export_drafter(trained_like(args), args, target)
    (target / "stale.txt").write_text("from an older export")
    export_drafter(trained_like(args), args, target)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    assert os.listdir(tmp_path) == ["export"]  # no temporary directories left behind


# ----------------------------------------------------------------------------------------------
# Public inference code (PyPI `dflash`, the z-lab implementation).

def _public_model_class():
    """The public loader; a failed import is a skip on a developer's machine, a failure in CI (where
    `CI` is set, as every CI service does): there `make install` installed it, and a skip would let
    the one check against the public code vanish silently."""
    try:
        from dflash.model import DFlashDraftModel
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        why = (f"public `dflash` package not importable ({type(exc).__name__}: {exc}); "
               "install it with `pip install --no-deps dflash==0.1.0` (part of `make install`)")
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(why)
        pytest.skip(why)
    return DFlashDraftModel


def test_public_loader_missing_fails_in_ci_and_skips_elsewhere(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_dflash(name, *args, **kwargs):
        if name == "dflash" or name.startswith("dflash."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dflash)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="dflash==0.1.0"):
        _public_model_class()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="dflash==0.1.0"):
        _public_model_class()


PUBLIC_CASES = {
    "full": {},
    "mixed_small_window": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


# (export dtype, dtype the public model loads and runs in, tolerance). bf16 is what export_drafter
# writes by default (training exports): loaded in fp32, its values must be exactly the bf16-rounded
# weights (fp32 tolerance); run in bf16, as users load it, it is held to bf16 rounding: each
# activation rounds to 8 mantissa bits (2**-8 = 0.4% relative) over a dozen ops; on outputs of std 1
# (max 2.4) that left a max error of 0.017, about 2 bf16 steps at 2 (2**-7 = 0.008 each).
PUBLIC_DTYPES = {
    "fp32": (torch.float32, torch.float32, 1e-5),
    "bf16_export_fp32_run": (None, torch.float32, 1e-5),
    "bf16_export_bf16_run": (None, torch.bfloat16, 3e-2),
}


@pytest.mark.parametrize("dtype_name", list(PUBLIC_DTYPES))
@pytest.mark.parametrize("case", list(PUBLIC_CASES))
def test_public_loader_loads_export_and_agrees(tmp_path, case, dtype_name):
    DFlashDraftModel = _public_model_class()
    export_dtype, dtype, tol = PUBLIC_DTYPES[dtype_name]
    args = tiny_args(**PUBLIC_CASES[case])
    drafter = trained_like(args)
    if export_dtype is None:
        out = export_drafter(drafter, args, tmp_path / "e")  # the default
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
        with torch.no_grad():  # the reference: the exported (bf16-rounded) weights, computed in fp32
            for p in drafter.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    else:
        out = export_drafter(drafter, args, tmp_path / "e", dtype=export_dtype)
    public, info = DFlashDraftModel.from_pretrained(str(out), dtype=dtype, output_loading_info=True)
    public.eval()
    assert all(p.dtype == dtype for p in public.parameters())
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert public.target_layer_ids == args.target_layer_ids and public.block_size == B
    assert public.mask_token_id == MASK_ID

    # Inference: one block at positions start..start+B-1, context = hidden of positions < start.
    g = torch.Generator().manual_seed(1)
    start = 11
    T = start + B  # the row also holds the anchor and later tokens, which must stay invisible
    hidden = torch.randn(T, K * H, generator=g)
    embed = torch.randn(V, H, generator=g)
    input_ids = torch.randint(0, MASK_ID, (T,), generator=g)
    position_ids = torch.arange(T)
    anchors, valid = torch.tensor([start]), torch.tensor([True])
    block_ids, block_pos = build_blocks(input_ids, position_ids, anchors, B, MASK_ID)
    block_embeds = F.embedding(block_ids, embed)
    with torch.no_grad():
        attn = drafter.build_attention(anchors, valid, torch.zeros(T, dtype=torch.long), backend="dense")
        ours = drafter(hidden, block_embeds, position_ids, block_pos, attn)
        theirs = public(
            position_ids=torch.arange(start + B)[None],
            noise_embedding=block_embeds[None].to(dtype),
            target_hidden=hidden[None, :start].to(dtype),
        )[0]
    assert theirs.dtype == dtype
    torch.testing.assert_close(theirs.float(), ours, atol=tol, rtol=tol)


def _block_inputs(args, start, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(start + B, K * H, generator=g)
    embed = torch.randn(V, H, generator=g)
    input_ids = torch.randint(0, MASK_ID, (start + B,), generator=g)
    block_ids, _ = build_blocks(input_ids, torch.arange(start + B), torch.tensor([start]), B, MASK_ID)
    return hidden, F.embedding(block_ids, embed)


@pytest.mark.parametrize("case", list(PUBLIC_CASES))
def test_automodel_with_remote_code_loads_export_like_the_public_class(tmp_path, case):
    """The export's own modeling file, loaded the way public drafters load, computes what the public
    class computes from the same directory, with and without a KV cache across calls."""
    from transformers import AutoModel, DynamicCache

    DFlashDraftModel = _public_model_class()
    args = tiny_args(**PUBLIC_CASES[case])
    out = export_drafter(trained_like(args), args, tmp_path / "e", dtype=torch.float32,
                         chat_template_kwargs={"enable_thinking": False})
    ours, info = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32,
                                           output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(ours).__module__.endswith("modeling_dflash") and type(ours).__name__ == "DFlashDraftModel"
    assert ours.target_layer_ids == args.target_layer_ids and ours.block_size == B and ours.mask_token_id == MASK_ID
    assert ours.chat_template_kwargs == {"enable_thinking": False}
    public = DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32)
    ours.eval(), public.eval()
    theirs_state = public.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs_state[name]), name

    start = 11
    hidden, block_embeds = _block_inputs(args, start)
    with torch.no_grad():
        kw = dict(position_ids=torch.arange(start + B)[None], noise_embedding=block_embeds[None],
                  target_hidden=hidden[None, :start])
        torch.testing.assert_close(ours(**kw), public(**kw), atol=1e-5, rtol=1e-5)
        # Decoding: the cache holds earlier context and blocks (cropped back to the accepted ones).
        caches = [DynamicCache(config=m.config) for m in (ours, public)]
        for cache in caches:  # sliding layers roll back only when recording, as dflash_generate sets up
            if hasattr(cache, "activate_past_recording"):
                cache.activate_past_recording()
        split = 6
        for model, cache in zip((ours, public), caches):
            model(position_ids=torch.arange(split + B)[None], noise_embedding=block_embeds[None],
                  target_hidden=hidden[None, :split], past_key_values=cache, use_cache=True)
            cache.crop(split - cache.get_seq_length())  # drop the block: keep the context
        got, want = (model(position_ids=torch.arange(split, start + B)[None], noise_embedding=block_embeds[None],
                           target_hidden=hidden[None, split:start], past_key_values=cache, use_cache=True)
                     for model, cache in zip((ours, public), caches))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
