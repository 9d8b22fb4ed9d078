"""What the LLM recipe does to a model's input embeddings: upstream's ``neftune:`` (NEFTune, noisy embeddings while
training) and ``embedding_row_repair:`` (damaged rows of a checkpoint's input embedding rebuilt from the output
embedding before training); and upstream's top-level ``nvtx`` switch, accepted off."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from automodel.config import Config, FieldErrors
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.parallelism import model_hf_config


@dataclass
class NEFTuneConfig:
    """``neftune:``: NEFTune (Jain et al., 2023): while training, uniform noise in ``[-a, a]`` with ``a =
    noise_alpha / sqrt(sequence length x hidden size)`` is added to the input embeddings (validation and
    generation see the embeddings unchanged); transformers' own hook does it."""

    noise_alpha: float | None = field(default=None, metadata={"help": (
        "the noise's scale alpha (> 0; the paper's values: 5 to 15); null: no noise")})

    def __post_init__(self) -> None:
        if self.noise_alpha is not None and self.noise_alpha <= 0:
            raise FieldErrors({"noise_alpha": f"must be > 0 (the paper uses 5 to 15), found {self.noise_alpha}: "
                                              "or null (no noise)"})


def add_neftune_noise(model: torch.nn.Module, noise_alpha: float) -> torch.nn.Module:
    """Hook NEFTune onto ``model``'s input embeddings (a Hugging Face or peft model); returns the embedding module."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    embeddings = model.get_input_embeddings()
    embeddings.neftune_noise_alpha = noise_alpha
    embeddings.register_forward_hook(neftune_post_forward_hook)
    return embeddings


def nvtx_issues(value: object) -> list[ConfigIssue]:
    """``nvtx``: upstream wraps every module in NVTX ranges for NVIDIA Nsight Systems when true; off (false, or
    not given) is the only setting here."""
    if value is None or value is False:
        return []
    if value is not True:
        return [ConfigIssue("nvtx", f"expected true or false, found {value!r}")]
    what = "true wraps every module's forward and backward in NVTX ranges for NVIDIA Nsight Systems"
    if not torch.cuda.is_available():
        return [ConfigIssue("nvtx", f"{what}, which need a CUDA GPU (this machine has none): set false")]
    return [ConfigIssue("nvtx", f"{what}, which this build does not add: set false (profile with torch.profiler)")]


@dataclass
class EmbeddingRowRepairConfig:
    """``embedding_row_repair:`` (upstream's): before training, every input-embedding row whose L2 norm is not finite
    or at most ``min_norm`` (a damaged checkpoint's near-zero rows, whose rare tokens then give extreme gradients) is
    replaced by its token's output-embedding row, scaled to the RMS norm of the healthy input rows. Absent: off."""

    enabled: bool = field(default=True, metadata={"help": "repair (the section given); false: leave the rows"})
    min_norm: float = field(default=1.0e-6, metadata={"help": "a row with an L2 norm at or below this is damaged"})
    max_rows: int = field(default=256, metadata={"help": (
        "safety bound: more damaged rows than this stop the run unchanged (a mismatched checkpoint, not a few rows)")})

    def __post_init__(self) -> None:
        errors = {}
        if self.min_norm < 0:
            errors["min_norm"] = f"must be >= 0, found {self.min_norm}"
        if self.max_rows < 1:
            errors["max_rows"] = f"must be >= 1, found {self.max_rows}"
        if errors:
            raise FieldErrors(errors)


def repair_issues(cfg: Config, sharded: bool) -> list[ConfigIssue]:
    """What stops ``embedding_row_repair`` before anything is built: embeddings split over ranks (``sharded``), or a
    model whose config (readable here) ties its output embedding to the input one."""
    issues = []
    if sharded:
        issues.append(ConfigIssue("embedding_row_repair", "the repair reads and rewrites whole embedding rows, which "
                                  "FSDP2, tensor and pipeline parallelism split over ranks (not supported here): "
                                  "repair in one process (or with strategy: ddp) and train from its checkpoint"))
    hf_config = model_hf_config(cfg)
    if hf_config is not None and getattr(hf_config, "tie_word_embeddings", False):
        issues.append(ConfigIssue("embedding_row_repair", "the model ties its output embedding to the input one "
                                  "(tie_word_embeddings: true), so no separate output row can rebuild a damaged "
                                  "input row: remove the section"))
    return issues


@torch.no_grad()
def repair_embedding_rows(model: torch.nn.Module, min_norm: float, max_rows: int) -> str:
    """Repair ``model``'s damaged input-embedding rows in place (see EmbeddingRowRepairConfig); what was done, for
    the log. An ``AutomodelError``, with nothing changed, when the repair cannot be trusted."""
    key = "embedding_row_repair"
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or outputs.weight is inputs.weight:
        raise AutomodelError(f"{key}: the model has no separate output embedding (its input and output embeddings "
                             "are one tied matrix), so there is nothing to rebuild the damaged rows from; remove the "
                             "section")
    weight, source = inputs.weight, outputs.weight
    if isinstance(weight, DTensor) or isinstance(source, DTensor) or weight.shape != source.shape:
        raise AutomodelError(f"{key}: the input embedding {tuple(weight.shape)} and output embedding "
                             f"{tuple(source.shape)} must be plain tensors of one shape (a sharded embedding is not "
                             "repaired here: run the repair in one process and save the checkpoint)")
    norms = weight.float().norm(dim=-1)
    damaged = ~torch.isfinite(norms) | (norms <= min_norm)
    ids = damaged.nonzero().flatten().tolist()
    if not ids:
        return f"{key}: no input-embedding row at or below min_norm {min_norm:g}; the embedding is unchanged"
    if len(ids) > max_rows:
        raise AutomodelError(f"{key}: {len(ids)} damaged input-embedding rows, more than max_rows {max_rows}: the "
                             "checkpoint is broadly damaged or does not match the model; check it (nothing changed)")
    replacement = source[ids].float()
    source_norms = replacement.norm(dim=-1)
    bad = [i for i, n in zip(ids, source_norms.tolist(), strict=True) if not math.isfinite(n) or n <= min_norm]
    if bad:
        raise AutomodelError(f"{key}: the output-embedding rows of tokens {bad[:20]} are damaged too, so they cannot "
                             "rebuild the input rows (nothing changed)")
    target = norms[~damaged].pow(2).mean().sqrt()
    weight[ids] = (replacement / source_norms.unsqueeze(-1) * target).to(weight.dtype)
    shown = ", ".join(map(str, ids[:20])) + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
    before = norms[ids].min().item()
    return (f"{key}: rebuilt {len(ids)} input-embedding rows (tokens {shown}; smallest norm {before:.3g}) from their "
            f"output-embedding rows, scaled to the healthy rows' RMS norm {target.item():.4g}")
