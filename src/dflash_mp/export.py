"""Export a trained drafter in the layout the public DFlash inference code loads.

The directory holds `config.json` (a Qwen3 config plus the DFlash fields, `architectures:
["DFlashDraftModel"]`) and `model.safetensors` with the drafter's own tensors under their public
names: no embedding, no LM head (inference takes both from the target). It also holds
`modeling_dflash.py` (this package's `dflash_mp.modeling_dflash`) and an `auto_map` naming it, so
`AutoModel.from_pretrained(path, trust_remote_code=True)` loads it as the public drafters load. It
is written into a temporary sibling directory and renamed into place, so a reader never sees half
an export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from dflash_mp.model.drafter import DFlashDrafter, DrafterArgs
from dflash_mp.target import TargetSpec

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
MODELING_NAME = "modeling_dflash.py"
MODELING_SOURCE = Path(__file__).with_name(MODELING_NAME)


def drafter_config(args: DrafterArgs, dtype: torch.dtype, target_config: dict | None = None,
                   chat_template_kwargs: dict | None = None) -> dict:
    """The `config.json` dict for `args`, checked against the target's config when given.

    `chat_template_kwargs`: the template options the training data was rendered with (e.g.
    `{"enable_thinking": false}`), recorded so that serving and `evaluate` can render the same way.
    """
    if target_config is not None:
        for key in ("hidden_size", "vocab_size"):
            theirs = target_config.get(key)
            if theirs is not None and theirs != getattr(args, key):
                raise ValueError(
                    f"drafter {key}={getattr(args, key)} differs from the target's {key}={theirs}; the "
                    "drafter reuses the target's embedding and LM head, so build it with the target's value"
                )
    # Public configs use `num_target_layers` for the TARGET's depth (their fallback derives layer
    # ids from it), not for the number of captured layers. Without the target config, the deepest
    # captured layer bounds it from below.
    if target_config is not None and "num_hidden_layers" in target_config:
        target_depth = int(target_config["num_hidden_layers"])
    else:
        target_depth = max(args.target_layer_ids) + 1
    layer_types = args.resolved_layer_types
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": {"AutoModel": f"{MODELING_NAME.removesuffix('.py')}.{ARCHITECTURE}"},
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "max_position_embeddings": args.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": args.block_size,
        "num_target_layers": target_depth,
        "layer_types": layer_types,
        # Qwen3Config drops sliding_window unless use_sliding_window is set.
        "use_sliding_window": args.has_sliding,
        "sliding_window": args.sliding_window,
        "max_window_layers": args.num_layers,
        "dflash_config": {
            "target_layer_ids": list(args.target_layer_ids),
            "mask_token_id": args.mask_token_id,
            "chat_template_kwargs": dict(chat_template_kwargs or {}),
        },
    }


def args_from_config(config: dict) -> DrafterArgs:
    """Inverse of `drafter_config` (also reads exports whose rope lives in `rope_parameters`)."""
    dflash = config.get("dflash_config", {})
    spec = TargetSpec.from_config(config)  # a Qwen3 decoder config: the same fields as a target's
    sliding = config.get("use_sliding_window", True)
    return DrafterArgs(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        target_layer_ids=list(dflash.get("target_layer_ids", config.get("target_layer_ids", []))),
        mask_token_id=dflash.get("mask_token_id", config.get("mask_token_id")),
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        rope_scaling=spec.rope_scaling,
        max_position_embeddings=spec.max_position_embeddings,
        block_size=dflash.get("block_size", config.get("block_size", 16)),
        layer_types=config.get("layer_types"),
        sliding_window=config.get("sliding_window") if sliding else None,
    )


def job_yaml(job) -> str:
    """The resolved job config (a `config.JobConfig`) as YAML, as a run shows it next to its scalars."""
    return OmegaConf.to_yaml(OmegaConf.structured(job))


def _write_synced(path: Path, write) -> None:
    write(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def export_drafter(
    drafter: DFlashDrafter,
    args: DrafterArgs,
    out_dir: str | os.PathLike,
    target_config: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    state: dict[str, torch.Tensor] | None = None,
    chat_template_kwargs: dict | None = None,
    run_id: str | None = None,
) -> Path:
    """Write `config.json` and `model.safetensors` (tensors cast to `dtype`) into `out_dir`.

    `state`: the weights to write (the trainer's fp32 master weights), else `drafter.state_dict()`.

    `run_id`: the training run's id, kept in the safetensors metadata (`dflash_run_id`).

    An existing `out_dir` is replaced as a whole. Returns the final path.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    config = drafter_config(args, dtype, target_config, chat_template_kwargs)
    # Unwrapped tensors only: `.contiguous().clone()` also breaks any storage sharing, which
    # safetensors refuses to serialise.
    tensors = {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in (state or drafter.state_dict()).items()}

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        meta = {"format": "pt", **({"dflash_run_id": run_id} if run_id else {})}
        _write_synced(tmp / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata=meta))
        _write_synced(tmp / CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
        _write_synced(tmp / MODELING_NAME, lambda p: shutil.copyfile(MODELING_SOURCE, p))
        if out_dir.exists():
            # A directory cannot be replaced atomically; move the old one aside first so the new
            # one appears in a single rename, then drop the old one.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "x")
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def exported_chat_template_kwargs(path: str | os.PathLike) -> dict | None:
    """The template options an export was trained with; None for exports that predate the record."""
    config = json.loads((Path(path) / CONFIG_NAME).read_text())
    return config.get("dflash_config", {}).get("chat_template_kwargs")


def check_export_dir(path: str, setting: str = "checkpoint") -> None:
    """ValueError naming `setting` and the export to use when `path` is not an export directory (a
    training checkpoint, a run directory, or nothing)."""
    if os.path.isfile(os.path.join(path, CONFIG_NAME)) and os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        return
    p = Path(path).resolve()
    run_dir = None
    if (p / "manifest.json").is_file() or p.parent.name == "checkpoints":  # <run_dir>/checkpoints/step_N
        run_dir = p.parent.parent
        what = "a training checkpoint (optimizer state and rng, not an export)"
    elif (p / "export").is_dir() or (p / "checkpoints").is_dir():
        run_dir, what = p, "a run directory"
    else:
        what = f"a directory without {CONFIG_NAME} and {WEIGHTS_NAME}" if p.is_dir() else "not a directory"
    hint = f"the export of that run lives in {run_dir / 'export'}: pass {setting}={run_dir / 'export'}" \
        if run_dir is not None else f"pass an export directory, e.g. {setting}=outputs/default/export"
    if run_dir is not None and not (run_dir / "export" / CONFIG_NAME).is_file():
        hint += " (it has none yet: only a finished training run exports)"
    raise ValueError(f"{setting}={path} is {what}; {hint}.")


def load_exported(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> tuple[DFlashDrafter, DrafterArgs]:
    """Load an export back into a `DFlashDrafter` (in the stored dtype unless `dtype` is given)."""
    path = Path(path)
    config = json.loads((path / CONFIG_NAME).read_text())
    args = args_from_config(config)
    state = load_file(str(path / WEIGHTS_NAME), device=str(device))
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    drafter = DFlashDrafter(args).to(device=device, dtype=dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter, args
