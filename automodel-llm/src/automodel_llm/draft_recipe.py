"""What the speculative-decoding draft recipes share (EAGLE-1/2: :mod:`automodel_llm.eagle`; EAGLE-3:
:mod:`automodel_llm.eagle3`): the ``model`` section is the target, built as the next-token recipe builds it and
frozen; the run's model is the draft the recipe makes for it, which the engine trains, shards, checkpoints and
resumes like any model (``distributed.tp_size`` splits the target's layers over tensor-parallel ranks, which train
one copy of the draft on the same batch; ``ep_size`` splits a mixture-of-experts target's experts over the ranks;
``strategy: fsdp2`` shards the target's weights: as upstream's recipes do). Upstream's form (``recipe_args:``;
``optimizer:`` without ``_target_``, its ``warmup_ratio`` / ``min_lr_ratio`` driving upstream's warmup + cosine
schedule; validation after each epoch) is read as the sections it stands for."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from automodel.config import Config, KeyAlias, Target
from automodel.errors import AutomodelError, ConfigIssue
from automodel.meta_build import building_whole
from automodel.training.context import BuildContext
from automodel.training.dist import all_reduce_sum
from automodel.training.parallelism import model_hf_config
from automodel.training.step_scheduler import StepScheduler
from automodel_llm.eagle3.unroll import drafted_slots, supervised_tokens
from automodel_llm.recipe import DATASETS, FinetuneRecipeForNextTokenPrediction

CHAT_DATASET = "automodel_llm.datasets.ChatDataset"


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float = 0.05,
                  min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Upstream's EAGLE schedule: the learning rate rises linearly over ``warmup_ratio`` of the run's steps (at
    least one), step ``s`` (from 0) at ``(s + 1) / warmup`` of the peak, then falls along a cosine to ``min_lr_ratio``
    of it at the run's last step."""
    if not 0 <= warmup_ratio <= 1 or not 0 <= min_lr_ratio <= 1:
        raise AutomodelError(f"lr_scheduler: warmup_ratio {warmup_ratio} and min_lr_ratio {min_lr_ratio} must each "
                             "be in [0, 1]")
    warmup = max(1, int(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(max((step - warmup) / max(1, total_steps - warmup), 0.0), 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def saved_draft(path: Path, key: str) -> Path:
    """Where the config key ``key`` (a saved draft's weights) points, read as upstream's form of it is: a ``LATEST``
    in it is the checkpoint that run's ``LATEST`` file names (upstream's is a link to it), and ``model/consolidated``
    is ``model/`` (upstream keeps the consolidated files one folder down)."""
    from automodel.training.checkpoint import read_latest

    parts = path.parts
    if "LATEST" in parts and not path.exists():
        at = parts.index("LATEST")
        latest = read_latest(Path(*parts[:at]))
        path = latest.joinpath(*parts[at + 1:]) if latest is not None else path
    if path.name == "consolidated" and not path.exists() and path.parent.is_dir():
        path = path.parent
    if not path.exists():
        raise AutomodelError(f"{key}: {path} does not exist (name the model/ directory of a draft this recipe saved, "
                             "or its checkpoint_dir/LATEST/model)")
    return path


def read_draft_weights(path: Path, key: str) -> dict[str, torch.Tensor]:
    """The tensors of a saved draft (``key``'s ``model/`` directory or one ``.safetensors`` file; safetensors only,
    never a pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = saved_draft(path, key)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise AutomodelError(f"{key}: {path} holds no .safetensors file (name a draft's model/ directory or its "
                             "model.safetensors)")
    try:
        return {name: tensor for f in files for name, tensor in load_file(f).items()}
    except (SafetensorError, OSError) as err:
        raise AutomodelError(f"{key}: {path}: {err}") from None


def load_saved_draft(draft: torch.nn.Module, path: Path, key: str, hint: str,
                     optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Load the saved draft at ``path`` (``key``'s value) into ``draft``, whose names and shapes it must have (but
    for the ``optional`` ones; ``hint``: which settings must be the saved draft's); the tensors read."""
    weights = read_draft_weights(path, key)
    own = draft.state_dict()
    missing = sorted(set(own) - set(weights) - set(optional))
    unknown = sorted(set(weights) - set(own))
    wrong = sorted(name for name in set(weights) & set(own) if weights[name].shape != own[name].shape)
    if missing or unknown or wrong:
        raise AutomodelError(f"{key}: {path} is not a draft of this one's sizes: missing {missing[:3]}, unknown "
                             f"{unknown[:3]}, other shapes {wrong[:3]} ({hint} must be the saved draft's)")
    draft.load_state_dict(weights, strict=False)
    return weights


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A weight of the target as a plain tensor: gathered when FSDP2 or tensor parallelism splits the target (every
    rank calls this). Torch's warning that a weight split over both gathers in two steps is silenced: a one-off copy
    while the recipe is built, not a cost of the training steps."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        return tensor.full_tensor()
    finally:
        redistribute.setLevel(level)


class EpochEndValidation(StepScheduler):
    """Validates after each epoch's last step too (upstream's EAGLE rule, where no val_check_interval is set)."""

    def is_val_step(self) -> bool:
        return super().is_val_step() or self.is_epoch_end()


class DraftRecipe(FinetuneRecipeForNextTokenPrediction):
    """Trains a speculative-decoding draft (the run's model) against the frozen ``model`` section's target.
    Subclasses name their settings section (``settings_key``), make the draft (:meth:`build_model` after
    :meth:`build_target`) and compute its loss."""

    settings_key: ClassVar[str]
    loss_description: ClassVar[str]  # what the loss is, for the refusal of loss_fn
    adds_mtp_loss = False
    tensor_parallel_unsupported = None  # tp_size splits the target (build_target); the draft stays whole
    pipeline_parallel_unsupported = "the draft is one or two layers, which pipeline stages cannot split; use pp_size: 1"
    context_parallel_unsupported = ("the draft's inputs are the target's states shifted along whole sequences, which "
                                    "context parallelism splits over ranks; use cp_size: 1")
    encoder_decoder_unsupported = "EAGLE drafts for a causal target; the target is an encoder-decoder"
    sections: ClassVar[dict] = {
        "model": Target("the frozen target model: {_target_: ..., ...} (default: AutoModelForCausalLM."
                        "from_pretrained)", required=True, plain=True,
                        default_target="automodel_llm.AutoModelForCausalLM.from_pretrained"),
        "dataset": Target("the training conversations (default: ChatDataset)", required=True,
                          runtime_args=("tokenizer",), documented_targets=DATASETS, plain=True,
                          default_target=CHAT_DATASET),
        "validation_dataset": Target("validation conversations (default: ChatDataset); without val_check_interval "
                                     "validated after each epoch", runtime_args=("tokenizer",),
                                     documented_targets=DATASETS, plain=True, default_target=CHAT_DATASET),
        "optimizer": Target("the draft's optimizer (default: AdamW, betas [0.9, 0.95], weight decay 0, upstream's)",
                            runtime_args=("params", "model"), plain=True, default_target="torch.optim.AdamW",
                            default={"_target_": "torch.optim.AdamW", "lr": 1e-4, "betas": [0.9, 0.95],
                                     "weight_decay": 0.0}),
        "lr_scheduler": Target("the schedule (default: upstream's EAGLE warmup and cosine: warmup_ratio 0.05, "
                               "min_lr_ratio 0.1)", runtime_args=("optimizer", "total_steps"), plain=True,
                               default_target="automodel_llm.draft_recipe.warmup_cosine", default={}),
        "optimizer.warmup_ratio": KeyAlias("lr_scheduler.warmup_ratio", "upstream's place for the schedule's "
                                           "warmup fraction"),
        "optimizer.min_lr_ratio": KeyAlias("lr_scheduler.min_lr_ratio", "upstream's place for the schedule's "
                                           "floor"),
    }
    target: torch.nn.Module
    target_class: str  # the target's class name, for the logs
    validation_counts: torch.Tensor | None = None  # a validation's counts so far (count_for_validation)

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        for key in ("eval_generation", "tool_call_eval", "neftune", "embedding_row_repair", "moe_metrics"):
            node = cfg.get(key) if key in cfg else None
            if node is not None and getattr(node, "enabled", True) and (key != "neftune" or node.noise_alpha):
                issues.append(ConfigIssue(key, "acts on the trained model, which is the draft here (it neither "
                                          "generates text alone nor has experts); remove the section"))
        for key, why in (("loss_fn", f"the loss is {cls.loss_description}"),
                         ("freeze", f"the draft trains whole but for its embeddings "
                                    f"({cls.settings_key}.freeze_embeddings)"),
                         ("qat", "quantisation-aware training of the draft is not built here")):
            node = cfg.get(key) if key in cfg else None
            if node is not None and getattr(node, "enabled", True) is not False:
                issues.append(ConfigIssue(key, f"{why}: remove the section"))
        settings = cfg.distributed
        if settings is not None and settings.tp_size > 1 and settings.sequence_parallel:
            issues.append(ConfigIssue("distributed.sequence_parallel", "true: the draft reads the target's hidden "
                                      "states of whole sequences, which sequence parallelism would leave split over "
                                      "the tensor-parallel ranks; set it false (tp_size still splits the target)"))
        return issues

    @classmethod
    def target_text_config(cls, cfg: Config) -> Any:
        """The target's text config as validation reads it (None: it cannot be read before the build)."""
        target = model_hf_config(cfg)
        if target is None:
            return None
        return target.get_text_config() if hasattr(target, "get_text_config") else target

    def build_target(self, ctx: BuildContext) -> torch.nn.Module:
        """The frozen target (kept as ``self.target``), built whole on every rank, then split as upstream splits it:
        with ``distributed.tp_size > 1`` its layers over the tensor-parallel ranks by the core's plan, its output
        head returning whole logits and its hidden states whole on each rank (the draft, whole on each, reads the
        same on all of them: :meth:`after_model_built`); with ``ep_size > 1`` the experts of a mixture-of-experts
        target over the ep groups of the data-parallel ranks (the draft has none); and with ``strategy: fsdp2`` its
        other weights sharded over the data-parallel ranks by FSDP2, as the draft's are (every rank runs each
        forward of the target together), unless :meth:`shards_target` says no."""
        from automodel.training.model_init import expert_parallelize, tensor_parallelize
        from automodel.training.stages.sharding import wrap_fsdp2

        with building_whole():
            target = super().build_model(ctx)
        target.to(ctx.device).eval().requires_grad_(False)
        self.target_class = type(target).__name__  # before FSDP2 names it FSDP<class>
        if ctx.mesh.tp > 1:
            self.log(f"target: {tensor_parallelize(ctx, target, vocab_parallel=False)}")
        if (getattr(ctx.cfg.distributed, "ep_size", None) or 1) > 1:
            self.log(f"target: {expert_parallelize(ctx, target)}")
        if ctx.fsdp2 and ctx.device_mesh is not None and self.shards_target():
            target, how = wrap_fsdp2(ctx, target)
            self.log(f"target: {how}")
        self.target = target
        return target

    def shards_target(self) -> bool:
        """Whether FSDP2 splits the target under ``strategy: fsdp2`` (DSpark's ``shard_dense_target: false`` keeps
        it whole)."""
        return True

    def share_embeddings(self, draft: torch.nn.Module, frozen: bool) -> None:
        """The draft's token embeddings: the target's, ``frozen`` or trained."""
        with torch.no_grad():
            weight = whole(self.target.get_input_embeddings().weight.detach())
            draft.embed_tokens.weight.copy_(weight.to(draft.embed_tokens.weight.dtype))
        draft.embed_tokens.weight.requires_grad_(not frozen)

    def after_model_built(self, ctx: BuildContext, model: torch.nn.Module, meta: Any) -> BuildContext:
        """The run's model is the draft, whole on every tensor-parallel rank, whose layers have no experts:
        ``tp_size`` and ``ep_size`` split the target."""
        return replace(super().after_model_built(ctx, model, meta), splits_run_model=False)

    def settings(self) -> Any:
        """The recipe's settings section (its defaults where the config leaves it out)."""
        return self.cfg.get(self.settings_key) or self.sections[self.settings_key]()

    def build_step_scheduler(self, ctx: BuildContext, steps_per_epoch: int | None) -> StepScheduler:
        if self.val_dataloaders and self.cfg.step_scheduler.val_check_interval is None:
            return EpochEndValidation(self.cfg.step_scheduler, ctx.batch.grad_accumulation_steps, steps_per_epoch)
        return super().build_step_scheduler(ctx, steps_per_epoch)

    # ---- what both drafts' losses read ------------------------------------------------------------------------

    def drafted(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's slots a draft's first step trains on (``[batch, seq]``, on the batch's device)."""
        ids = batch["input_ids"]
        return drafted_slots(supervised_tokens(batch["labels"], self.label_offset).to(ids.device),
                             batch.get("position_ids"))

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(self.drafted(batch).sum())

    def run_target(self, batch: dict[str, torch.Tensor]) -> Any:
        """The frozen target's outputs on the batch, with every layer's hidden states (packed rows: transformers
        keeps attention within each sample by their restarting ``position_ids``, with ``use_cache=False``)."""
        with torch.no_grad():
            return self.target(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                               position_ids=batch.get("position_ids"), output_hidden_states=True, use_cache=False)

    def count_for_validation(self, counts: torch.Tensor) -> None:
        """Add a validation micro-batch's counts (a tensor of the recipe's shape) to the validation's."""
        counts = counts.detach().double()
        self.validation_counts = counts if self.validation_counts is None else self.validation_counts + counts

    def validation_totals(self) -> torch.Tensor | None:
        """The validation's counts summed over the data-parallel ranks (None: none counted), then cleared."""
        counts, self.validation_counts = self.validation_counts, None
        if counts is not None and self.ctx.mesh.dp > 1:
            summed = all_reduce_sum(*counts.flatten(), device=self.device, group=self.data_parallel_group())
            counts = torch.stack(summed).reshape(counts.shape).double()
        return counts
