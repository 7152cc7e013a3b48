"""``doctor`` check 7: the ``--model-path`` / ``--speculative-draft-model-path`` checkpoints.

The paths exist, the target's architecture is one SGLang's DFlash drafter can serve under DDTree, and the
drafter's block size is in the range DDTree supports. ``sglang_kdtree.cli.doctor`` runs these and re-exports them;
this module imports nothing from it (the report and the SGLang pin come from ``doctor_install``).
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_kdtree.cli.doctor_install import Report, sglang_pin


def _read_json(path: Path) -> dict:
    import json

    with open(path) as f:
        return json.load(f)


def _local_checkpoint(
    report: Report, flag: str, given: str, fix_missing: str, fix_no_config: str
) -> Path | None | bool:
    """The checkpoint folder ``flag`` names: its Path; None (with a warning) for a Hub id; False on a failure."""
    from sglang_kdtree.plugin import missing_path_problem

    problem = missing_path_problem(flag, given)
    if problem:
        report.fail(problem, fix_missing)
        return False
    if not os.path.exists(os.path.expanduser(given)):
        report.warn(f"{flag} {given} is not a local path: SGLang will fetch it from the Hugging Face Hub; doctor "
                    "checks local checkpoints only", None)
        return None
    path = Path(os.path.expanduser(given))
    if not (path / "config.json").is_file():
        report.fail(f"{flag} {path} has no config.json", fix_no_config)
        return False
    return path


def check_target(report: Report, model_path: str, trust_remote_code: bool) -> int | None | bool:
    """False on a failure; else the target's layer count (None when it was not read)."""
    path = _local_checkpoint(report, "--model-path", model_path, "pass the target checkpoint's directory",
                             "pass the directory of a Hugging Face checkpoint")
    if not path:
        return path
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    try:
        config = ModelConfig(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:
        report.fail(f"SGLang cannot read the target config {path / 'config.json'} ({type(exc).__name__}: {exc})",
                    "pass --trust-remote-code if the model needs its own code (as the server would)")
        return False
    archs = list(getattr(config.hf_config, "architectures", None) or [])
    from sglang.srt.models.registry import ModelRegistry

    try:
        model_cls, arch = ModelRegistry.resolve_model_cls(archs)
    except Exception as exc:
        report.fail(f"target architecture {archs} is not one SGLang {sglang_pin()} serves ({exc})",
                    "use a target model SGLang supports")
        return False
    reasons = []
    if not hasattr(model_cls, "set_dflash_layers_to_capture"):
        reasons.append(f"{model_cls.__name__} cannot hand its hidden states to a DFlash drafter "
                       "(no set_dflash_layers_to_capture)")
    if config.attention_arch not in (AttentionArch.MHA, AttentionArch.MLA):
        reasons.append(f"its attention is {config.attention_arch.name}, not MHA or MLA")
    if mambaish_config(config) is not None:
        reasons.append("it has linear-attention / Mamba layers, whose state a tree verify cannot branch")
    if reasons:
        report.fail(f"target architecture {arch} is not supported by DDTree: " + "; ".join(reasons),
                    "use an MHA or MLA transformer target that SGLang's DFlash supports (e.g. Llama, Qwen3, "
                    "DeepSeek-V3, Kimi K2)")
        return False
    report.ok(f"target {path}: {arch}, {config.attention_arch.name} attention, {config.num_hidden_layers} layers")
    return int(config.num_hidden_layers)


def check_drafter(report: Report, draft_path: str, block_size: int | None, target_layers: int | None) -> bool:
    from sglang_kdtree.server import spec
    path = _local_checkpoint(report, "--speculative-draft-model-path", draft_path,
                             "pass the DFlash drafter checkpoint's directory",
                             "pass the directory of the DFlash drafter checkpoint")
    if not path:
        return path is None  # a Hub id passes (warned); a failure does not
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    try:
        draft = parse_dflash_draft_config(draft_hf_config=_read_json(path / "config.json"))
    except Exception as exc:
        report.fail(f"{path / 'config.json'} is not a DFlash drafter config ({type(exc).__name__}: {exc})",
                    "pass a DFlash block-diffusion drafter (DDTree drafts with DFlash)")
        return False
    source = "--speculative-dflash-block-size" if block_size is not None else "the drafter's config"
    block = block_size if block_size is not None else draft.block_size
    if block is None:
        report.fail(f"{path / 'config.json'} has no block_size (top level or dflash_config)",
                    "pass --speculative-dflash-block-size to the server")
        return False
    if not spec.MIN_BLOCK_SIZE <= int(block) <= spec.MAX_BLOCK_SIZE:
        fix = (f"pass a --speculative-dflash-block-size in [{spec.MIN_BLOCK_SIZE}, {spec.MAX_BLOCK_SIZE}], or omit it"
               if block_size is not None else
               f"use a drafter trained with a block size in [{spec.MIN_BLOCK_SIZE}, {spec.MAX_BLOCK_SIZE}]")
        report.fail(f"drafter block size {block} (from {source}) is outside [{spec.MIN_BLOCK_SIZE}, "
                    f"{spec.MAX_BLOCK_SIZE}]: DDTree drafts L = block_size - 1 <= 31 depths", fix)
        return False
    target_ids = list(draft.target_layer_ids or [])
    if target_layers is not None and target_ids and max(target_ids) >= target_layers:
        report.fail(f"drafter reads target layers {target_ids}, the target has {target_layers} layers",
                    "use the drafter trained for this target")
        return False
    report.ok(f"drafter {path}: block size {block} (from {source}), {int(block) - 1} draft depths")
    return True
