"""DFlash draft training (``automodel finetune dflash``; upstream's ``TrainDFlashRecipe``), JetSpec's
(``automodel finetune jetspec``; ``TrainJetSpecRecipe``: the same draft, its blocks attending causally within
themselves, trained towards the target's distributions), Domino's (``automodel finetune domino``;
``TrainDominoRecipe``: the draft with a GRU correction head) and DFlash 2's (``automodel finetune dflash2``;
``TrainDFlash2Recipe``: dynamic convolutions and a path selector).

The ``model`` section is the target: built as the next-token recipe builds it, frozen, and run on every batch for
the hidden states of ``dflash.target_layer_ids``. The trained model is the draft (:mod:`automodel_llm.dflash.draft`),
which the engine shards, checkpoints, resumes and writes to ``model/`` like any model, in the published DFlash
drafters' layout. Each step draws up to ``num_anchors`` blocks per row (each row from its own generator: a function
of the run's seed, the step and the row, so a resumed run and any data-parallel layout draw the same blocks), embeds
them with the target's embeddings, drafts them in one forward and scores the drafted slots with the target's output
head (:mod:`automodel_llm.dflash.blocks`).

The loss is the drafted slots' decay-weighted mean cross entropy over the whole step (upstream's over each
micro-batch; the same with one micro-batch a step), so any data-parallel layout and accumulation give the same
loss. Validation adds ``accuracy``
(drafted slots whose greedy token is right) and ``accept_length`` (tokens a verifier would accept per block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.distillation.loss import KDLoss
from automodel.training.parallelism import validation_device
from automodel_llm.dflash.blocks import (
    BlockLoss,
    Blocks,
    anchor_candidates,
    block_loss,
    block_positions,
    block_tokens,
    block_visibility,
    corrected_loss,
    distillation_loss,
    drafted_slots,
    draw_blocks,
    flex_block_mask,
    selector_loss,
)
from automodel_llm.dflash.draft import ARCHITECTURE, DFlashDraftModel, block_settings, draft_config
from automodel_llm.dflash.settings import (
    DFLASH2_RECIPE_ARGS,
    DOMINO_RECIPE_ARGS,
    JETSPEC_RECIPE_ARGS,
    RECIPE_ARGS,
    DFlash2Config,
    DFlashConfig,
    DominoConfig,
    JetSpecConfig,
    default_target_layers,
    flex_attention_issue,
    target_layer_issue,
)
from automodel_llm.draft_recipe import DraftRecipe, load_saved_draft, saved_draft, whole
from automodel_llm.eagle3.unroll import supervised_tokens
from automodel_llm.row_seeds import RowSeeds, SeededSteps


class BlockDraftRecipe(SeededSteps, DraftRecipe):
    """Trains a block-drafting draft (the run's model) against the frozen ``model`` section's target; subclasses
    name the settings section and compute the blocks' loss (:meth:`blocks_loss`)."""

    causal_blocks: ClassVar[bool] = False  # a block's slots see only the slots up to their own
    name: ClassVar[str]  # the method's name, for the logs
    served_by: ClassVar[str]  # the serving engines' names for it
    target_layer_ids: list[int]
    embedding_weight: torch.Tensor  # the target's, whole (keep_target_io)
    embedding_scale: Any  # the target's embedding scale (Gemma), None for most
    head_weight: torch.Tensor
    head_bias: torch.Tensor | None

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        settings = cfg.get(cls.settings_key)  # None: the section was refused (its issues are reported)
        packing = cfg.get("packed_sequence")
        if packing is not None and (packing.enabled or packing.packed_sequence_size > 0):
            issues.append(ConfigIssue("packed_sequence.packed_sequence_size", "the blocks read the target's "
                                      "states of whole rows here (packed samples would need per-sample anchors, "
                                      "masks and positions, not built); set it 0"))
        if settings is None:
            return issues
        if settings.attention_backend == "flex_attention" and (why := flex_attention_issue(
                validation_device().type == "cuda")):
            issues.append(ConfigIssue(f"{cls.settings_key}.attention_backend", why))
        text = cls.target_text_config(cfg)
        if text is not None:
            issues += cls.target_issues(settings, text)
        return issues

    @classmethod
    def target_issues(cls, settings: DFlashConfig, text: Any) -> list[ConfigIssue]:
        issues = []
        layers, vocab = getattr(text, "num_hidden_layers", None), getattr(text, "vocab_size", None)
        if isinstance(layers, int):
            why = target_layer_issue(settings.target_layer_ids, layers, settings.draft_num_hidden_layers,
                                     cls.default_layers, settings.lowest_target_layer)
            if why:
                issues.append(ConfigIssue(f"{cls.settings_key}.target_layer_ids", why))
        if isinstance(vocab, int) and not settings.mask_token_id < vocab:
            issues.append(ConfigIssue(f"{cls.settings_key}.mask_token_id", f"{settings.mask_token_id} is not a "
                                      f"token of the target, whose vocabulary holds {vocab} (0..{vocab - 1})"))
        heads = settings.draft_num_attention_heads or getattr(text, "num_attention_heads", None)
        kv_heads = settings.draft_num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads
        if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
            issues.append(ConfigIssue(f"{cls.settings_key}.draft_num_key_value_heads", f"{kv_heads} does not divide "
                                      f"the draft's {heads} attention heads"))
        return issues

    @staticmethod
    def default_layers(layers: int, draft_layers: int) -> list[int]:
        """The target layers the draft reads where ``target_layer_ids`` is unset (upstream's DFlash default)."""
        return default_target_layers(layers, draft_layers)

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        settings = cfg.get(cls.settings_key)
        if settings is None:
            return super().describe_plan(cfg)
        layers = settings.target_layer_ids or "an even spread of its"
        return [*super().describe_plan(cfg), f"{cls.name}: the model section is the frozen target; the trained model "
                f"is a {settings.draft_num_hidden_layers}-layer draft reading the target's layers {layers}, drafting "
                f"blocks of {settings.block_size} tokens ({settings.num_anchors} at most a row), loss "
                f"{cls.loss_words(settings)}"]

    @classmethod
    def loss_words(cls, settings: Any) -> str:
        """The loss, for the plan and the logs."""
        raise NotImplementedError

    # ---- building ---------------------------------------------------------------------------------------------

    def build_model(self, ctx: BuildContext) -> torch.nn.Module:
        """The frozen target (kept as ``self.target``) and the draft made for it, which is what this returns."""
        settings: DFlashConfig = self.settings()
        target = self.build_target(ctx)
        text = target.config.get_text_config()
        for issue in self.target_issues(settings, text):  # a target validation could not read
            raise AutomodelError(f"{issue.key}: {issue.message}")
        self.target_layer_ids = list(settings.target_layer_ids or self.default_layers(
            text.num_hidden_layers, settings.draft_num_hidden_layers))
        self.keep_target_io(target)
        draft = self.make_draft(text, settings)
        if settings.draft_weights_path:
            self.start_from(draft, Path(settings.draft_weights_path))
        self.seeds = RowSeeds(self.cfg.rng.seed)
        self.log(f"{self.name}: a {draft.config.num_hidden_layers}-layer draft for the frozen target "
                 f"{self.target_class} ({text.num_hidden_layers} layers; the draft reads the outputs of layers "
                 f"{self.target_layer_ids}), blocks of {settings.block_size} tokens, at most {settings.num_anchors} "
                 f"a row, mask token {settings.mask_token_id}, loss {self.loss_words(settings)}")
        return draft

    def start_from(self, draft: torch.nn.Module, path: Path) -> None:
        """Load the saved draft at ``path`` into ``draft``: its block keys (its config.json's, where it has one) and
        its tensors' names and shapes must be the draft's."""
        key = f"{self.settings_key}.draft_weights_path"
        path = saved_draft(path, key)
        config_file = (path if path.is_dir() else path.parent) / "config.json"
        if config_file.is_file():
            saved = block_settings(PretrainedConfig.from_json_file(str(config_file)))
            ours = block_settings(draft.config)
            for name in ("block_size", "mask_token_id", "target_layer_ids"):
                if saved.get(name) is not None and saved[name] != ours[name]:
                    raise AutomodelError(f"{key}: the saved draft's {name} is {saved[name]}, this run's {ours[name]}: "
                                         f"set {self.settings_key}.{name}: {saved[name]}")
        load_saved_draft(draft, path, key, f"{self.settings_key}.draft_num_hidden_layers, the draft's attention "
                         "sizes, the variant's head keys and the target")
        self.log(f"draft: started from the weights in {path}")

    def make_draft(self, text: Any, settings: Any) -> torch.nn.Module:
        """The fresh draft for the target's text config ``text``."""
        return DFlashDraftModel(draft_config(
            text, settings.draft_num_hidden_layers, settings.block_size, settings.mask_token_id,
            self.target_layer_ids, settings.attention_backend, settings.draft_sliding_window,
            settings.draft_num_attention_heads, settings.draft_num_key_value_heads, settings.draft_head_dim,
            self.draft_head(settings)))

    # ---- the loss ---------------------------------------------------------------------------------------------

    def draft_head(self, settings: Any) -> dict[str, Any] | None:
        """The draft's extra head (None: none; Domino's correction head)."""
        return None

    def supervised(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return supervised_tokens(batch["labels"], self.label_offset).to(batch["input_ids"].device)

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> float:
        """The weights of the batch's drafted slots, summed (the loss's denominator; the blocks drawn as
        :meth:`compute_loss` draws them)."""
        supervised = self.supervised(batch)
        return float(self.slot_weights(batch["input_ids"], supervised, self.draw(batch, supervised)).double().sum())

    def slot_weights(self, ids: torch.Tensor, supervised: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        """``[batch, n, block_size]``: each block slot's weight in the loss (0: not drafted)."""
        settings: DFlashConfig = self.settings()
        return drafted_slots(ids, supervised, blocks, settings.block_size, settings.loss_decay_gamma,
                             self.label_shift())[2]

    def label_shift(self) -> int:
        """How far past DFlash's the token a slot drafts lies (Domino's ``shift_label``: one)."""
        return 0

    def draw(self, batch: dict[str, torch.Tensor], supervised: torch.Tensor) -> Blocks:
        """The batch's blocks, each row's from the generator of its real tokens."""
        settings: DFlashConfig = self.settings()
        ids = batch["input_ids"].cpu()
        mask = batch.get("attention_mask")
        lengths = mask.sum(dim=1).cpu() if mask is not None else torch.full((ids.shape[0],), ids.shape[1])
        generators = [self.seeds.generator(ids[row, :lengths[row]]) for row in range(ids.shape[0])]
        base = settings.prefix_weight_base if settings.loss_type == "variable_prefix" else None
        return draw_blocks(self.candidates(supervised, lengths), settings.num_anchors, settings.block_size,
                           generators, base)

    def candidates(self, supervised: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` booleans: where a block can start (label tokens with a whole block after them)."""
        return anchor_candidates(supervised, self.settings().block_size, lengths)

    def keep_target_io(self, target: torch.nn.Module) -> None:
        """The target's (frozen) embeddings and output head, which embed the blocks and score the draft: gathered
        whole once, where FSDP2 or tensor parallelism splits them (every rank calls this), else the target's own."""
        embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
        self.embedding_weight = whole(embedding.weight.detach())
        self.embedding_scale = getattr(embedding, "embed_scale", None)  # Gemma-style scaled embeddings
        tied = head.weight is embedding.weight
        self.head_weight = self.embedding_weight if tied else whole(head.weight.detach())
        bias = getattr(head, "bias", None)
        self.head_bias = None if bias is None else whole(bias.detach())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's embeddings of ``ids``."""
        embedded = F.embedding(ids, self.embedding_weight)
        return embedded if self.embedding_scale is None else embedded * self.embedding_scale

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output head on the draft's states: the logits, in float32."""
        return F.linear(hidden.to(self.head_weight.dtype), self.head_weight, self.head_bias).float()

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's loss summed over its drafted slots with their weights (the loop divides by the step's
        weights); validation's counts kept for :meth:`extra_validation_metrics`."""
        settings: DFlashConfig = self.settings()
        ids = batch["input_ids"]
        supervised = self.supervised(batch)
        blocks = self.draw(batch, supervised)
        out = self.run_target(batch)
        states = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        length = ids.shape[1]
        context_positions = batch.get("position_ids")
        if context_positions is None:
            context_positions = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
        block_size, window = settings.block_size, settings.draft_sliding_window
        visibility = flex_block_mask if settings.attention_backend == "flex_attention" else block_visibility
        mask = visibility(blocks, length, block_size, window, self.causal_blocks)
        tokens = block_tokens(ids, blocks, block_size, settings.mask_token_id)
        output = model(**self.block_inputs(tokens), target_states=states,
                       position_ids=block_positions(context_positions, blocks, block_size), attention_mask=mask,
                       **self.extra_inputs(ids, blocks))
        result = self.blocks_loss(output, out.logits, ids, supervised, blocks, model.training)
        if model.training:
            for name, value in result.parts.items():
                self.add_loss_part(name, value)
        else:
            self.count_for_validation(torch.stack([result.correct, result.counted, result.accepted, result.blocks,
                                                   *result.extra]))
        return result.loss

    def block_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The draft's input of the blocks' ``tokens``: their embeddings by the target's (DSpark's draft embeds
        them itself)."""
        return {"block_embeddings": self.embed(tokens)}

    def extra_inputs(self, ids: torch.Tensor, blocks: Blocks) -> dict[str, torch.Tensor]:
        """What the draft's forward takes besides the blocks and the target's states (none: DFlash, JetSpec)."""
        return {}

    def blocks_loss(self, output: Any, target_logits: torch.Tensor, ids: torch.Tensor, supervised: torch.Tensor,
                    blocks: Blocks, training: bool) -> BlockLoss:
        """The blocks' loss from the draft's ``output`` (and the target's logits on the rows)."""
        raise NotImplementedError

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        """Over the validation set: ``accuracy`` (drafted slots whose greedy token is the right one: the data's, for
        JetSpec the target's) and ``accept_length`` (per block, 1 + the drafts before the first wrong one: what a
        verifier accepts)."""
        counts = self.validation_totals()
        return {} if counts is None else self.metrics_of(counts)

    def metrics_of(self, counts: torch.Tensor) -> dict[str, float]:
        """The validation's metrics from its summed counts (a variant's own after the four of :class:`BlockLoss`)."""
        correct, counted, accepted, blocks = counts[:4]
        return {"accuracy": (correct / counted.clamp_min(1)).item(),
                "accept_length": (accepted / blocks.clamp_min(1)).item()}

    def final_message(self, model_dir: Any) -> str:
        if not model_dir.is_dir():  # saved sharded only: the base message says how to export it
            return super().final_message(model_dir)
        return (f"the {self.name} draft is in {model_dir} ({ARCHITECTURE}, the published DFlash drafters' layout): "
                f"serve it as the speculative model of its target ({self.served_by})")


def decay_words(settings: DFlashConfig) -> str:
    """The slots' decay, for the logs."""
    return f" (decay gamma {settings.loss_decay_gamma})" if settings.loss_decay_gamma else ""


class DFlashRecipe(BlockDraftRecipe):
    """Trains a DFlash draft: each block's drafted slots towards the data's tokens (decay-weighted cross entropy)."""

    settings_key = "dflash"
    name = "DFlash"
    served_by = "SGLang's DFLASH algorithm, vLLM's dflash method"
    loss_description = "DFlash's decay-weighted cross entropy of the drafted block slots"
    sections: ClassVar[dict] = {"dflash": DFlashConfig, "recipe_args": RECIPE_ARGS}

    @classmethod
    def loss_words(cls, settings: DFlashConfig) -> str:
        return f"{settings.loss_type}{decay_words(settings)}"

    def blocks_loss(self, output: Any, target_logits: torch.Tensor, ids: torch.Tensor, supervised: torch.Tensor,
                    blocks: Blocks, training: bool) -> BlockLoss:
        settings: DFlashConfig = self.settings()
        return block_loss(self.head(output), ids, supervised, blocks, settings.block_size, settings.loss_decay_gamma)


class JetSpecRecipe(BlockDraftRecipe):
    """Trains a JetSpec draft (arXiv 2606.18394): DFlash's draft with causal attention within each block (a slot
    sees the slots up to its own, as a tree branch its ancestors), trained towards the target's distribution of
    each drafted token (forward KL at ``kd_temperature``, scaled by its square, every drafted slot alike)."""

    settings_key = "jetspec"
    name = "JetSpec"
    causal_blocks = True
    served_by = "vLLM's dflash method, which upstream names for JetSpec drafts"
    loss_description = "JetSpec's forward KL of the drafted block slots against the target's distributions"
    sections: ClassVar[dict] = {"jetspec": JetSpecConfig, "recipe_args": JETSPEC_RECIPE_ARGS}

    @classmethod
    def loss_words(cls, settings: JetSpecConfig) -> str:
        return f"forward KL against the target (temperature {settings.kd_temperature})"

    def blocks_loss(self, output: Any, target_logits: torch.Tensor, ids: torch.Tensor, supervised: torch.Tensor,
                    blocks: Blocks, training: bool) -> BlockLoss:
        settings: JetSpecConfig = self.settings()
        kl = KDLoss(settings.kd_temperature, chunk_size=settings.kd_chunk_size)
        return distillation_loss(self.head(output), whole(target_logits), ids, supervised, blocks,
                                 settings.block_size, kl)


def base_weight(step: int, total_steps: int, start: float, decay_ratio: float) -> float:
    """Domino's curriculum: the backbone-only loss's weight at ``step`` (from 0): ``start``, falling linearly to 0
    over the first ``decay_ratio`` of the run's ``total_steps``, then 0."""
    decay_steps = max(1, int(total_steps * decay_ratio))
    return min(1.0, max(0.0, start * (1 - min(step / decay_steps, 1.0))))


class DominoRecipe(BlockDraftRecipe):
    """Trains a Domino draft (SpecForge's Domino): DFlash's draft with a correction head. A GRU reads each block's
    tokens before the one a slot drafts; a low-rank projection of its state beside the slot's gives a correction
    added to the slot's logits (from ``correction_start`` on), so a block's drafts depend on the tokens before them.
    The loss mixes the corrected logits' cross entropy with the backbone's own, the latter's weight falling from
    ``lambda_base_start`` to 0 over the first ``lambda_base_decay_ratio`` of the run; validation scores the
    corrected logits."""

    settings_key = "domino"
    name = "Domino"
    served_by = "an engine that applies Domino's correction head (dflash_config.projector_type: domino)"
    loss_description = "Domino's mix of the corrected and the backbone's decay-weighted cross entropy"
    sections: ClassVar[dict] = {"domino": DominoConfig, "recipe_args": DOMINO_RECIPE_ARGS}

    @classmethod
    def loss_words(cls, settings: DominoConfig) -> str:
        return (f"the corrected logits' cross entropy (decay gamma {settings.loss_decay_gamma}), the backbone's "
                f"weighing {settings.lambda_base_start} falling to 0 over {settings.lambda_base_decay_ratio} of the "
                "run")

    def draft_head(self, settings: DominoConfig) -> dict[str, Any]:
        return {"projector_type": "domino", "emb_dim": settings.emb_dim, "gru_hidden_dim": settings.gru_hidden_dim,
                "pure_draft_prefix_len": settings.pure_draft_prefix_len, "shift_label": settings.shift_label}

    def label_shift(self) -> int:
        return 1 if self.settings().shift_label else 0

    def extra_inputs(self, ids: torch.Tensor, blocks: Blocks) -> dict[str, torch.Tensor]:
        """The embeddings of the row's tokens at each block slot (what the correction's GRU reads)."""
        at = blocks.anchors.unsqueeze(-1) + torch.arange(self.settings().block_size, device=ids.device)
        tokens = torch.gather(ids, 1, at.flatten(1).clamp(max=ids.shape[1] - 1))
        return {"previous_embeddings": self.embed(tokens)}

    def blocks_loss(self, output: Any, target_logits: torch.Tensor, ids: torch.Tensor, supervised: torch.Tensor,
                    blocks: Blocks, training: bool) -> BlockLoss:
        settings: DominoConfig = self.settings()
        hidden, correction = output
        weight = base_weight(self.step_scheduler.step, self.step_scheduler.total_steps, settings.lambda_base_start,
                             settings.lambda_base_decay_ratio) if training else 0.0
        return corrected_loss(self.head(hidden), correction, ids, supervised, blocks, settings.block_size,
                              settings.loss_decay_gamma, self.label_shift(), weight)


class DFlash2Recipe(BlockDraftRecipe):
    """Trains a DFlash 2 draft: DFlash's draft with a two-tap dynamic convolution before and after each sublayer
    (within a block: a slot reads the one before it) and a pairwise path selector over each slot's ``top_k``
    candidates; the loss is DFlash's block cross entropy plus ``selector_loss_weight`` times the selector's."""

    settings_key = "dflash2"
    name = "DFlash 2"
    served_by = "an engine that runs DFlash 2's convolutions and path selector"
    loss_description = "DFlash 2's block cross entropy and candidate-selection cross entropy"
    sections: ClassVar[dict] = {"dflash2": DFlash2Config, "recipe_args": DFLASH2_RECIPE_ARGS}

    @classmethod
    def loss_words(cls, settings: DFlash2Config) -> str:
        return (f"the block's cross entropy{decay_words(settings)} + {settings.selector_loss_weight} x the selector's "
                f"over {settings.selector_top_k} candidates")

    @classmethod
    def target_issues(cls, settings: DFlash2Config, text: Any) -> list[ConfigIssue]:
        issues = super().target_issues(settings, text)
        hidden, vocab = getattr(text, "hidden_size", None), getattr(text, "vocab_size", None)
        if isinstance(hidden, int) and hidden % settings.conv_group_size:
            issues.append(ConfigIssue("dflash2.conv_group_size", f"{settings.conv_group_size} does not divide the "
                                      f"draft's hidden size {hidden}"))
        if isinstance(vocab, int) and settings.selector_top_k > vocab:
            issues.append(ConfigIssue("dflash2.selector_top_k", f"{settings.selector_top_k} is more than the "
                                      f"target's {vocab} tokens"))
        return issues

    def draft_head(self, settings: DFlash2Config) -> dict[str, Any]:
        return {"conv_kernel_size": settings.conv_kernel_size, "conv_group_size": settings.conv_group_size,
                "selector_rank": settings.selector_rank, "selector_top_k": settings.selector_top_k}

    def extra_inputs(self, ids: torch.Tensor, blocks: Blocks) -> dict[str, Any]:
        """The target's output head (the selector scores the logits' top candidates inside the draft's forward)
        and the row's token before each slot's (teacher-forced predecessors)."""
        at = blocks.anchors.unsqueeze(-1) + torch.arange(self.settings().block_size, device=ids.device) - 1
        return {"output_head": self.head, "predecessors": torch.gather(ids, 1, at.flatten(1).clamp(min=0))}

    def blocks_loss(self, output: Any, target_logits: torch.Tensor, ids: torch.Tensor, supervised: torch.Tensor,
                    blocks: Blocks, training: bool) -> BlockLoss:
        settings: DFlash2Config = self.settings()
        _, logits, candidates, scores = output
        return selector_loss(logits, candidates, scores, ids, supervised, blocks, settings.block_size,
                             settings.loss_decay_gamma, settings.selector_loss_weight)
