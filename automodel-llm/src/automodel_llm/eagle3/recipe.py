"""EAGLE-3 draft training (``automodel finetune eagle3``; upstream's ``TrainEagle3Recipe``).

The ``model`` section is the target: built as the next-token recipe builds it, frozen, and run on every batch for
its hidden states (three layers, ``eagle3.aux_layer_ids``) and logits. The trained model is the draft
(:mod:`automodel_llm.eagle3.draft`), which the engine shards, checkpoints, resumes and writes to ``model/`` like any
model: a directory SGLang and vLLM serve as the speculative model of that target. Its vocabulary is the training
data's most frequent label tokens (``eagle3.draft_vocab_size``), chosen when the data set is built (or read from
``eagle3.selected_token_ids_path``) and saved with the weights (``d2t`` / ``t2d``), so a resumed run keeps it.

Upstream's form, ``recipe_args:`` with ``optimizer: {lr, betas, weight_decay, warmup_ratio, min_lr_ratio}``,
``checkpoint:``, ``dist_env:`` and ``distributed:``, is read as the sections its keys stand for
(:data:`~automodel_llm.eagle3.settings.RECIPE_ARGS`, :mod:`automodel_llm.draft_recipe`); what needs what this build
does not have is refused with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.modules import unwrap
from automodel_llm.draft_recipe import DraftRecipe, load_saved_draft
from automodel_llm.eagle3.draft import LlamaForCausalLMEagle3, draft_config
from automodel_llm.eagle3.parallel import cod_elements, counted_elements, reference_positions
from automodel_llm.eagle3.settings import RECIPE_ARGS, Eagle3Config, aux_layer_issue, default_aux_layers
from automodel_llm.eagle3.unroll import (
    most_frequent_tokens,
    read_token_ids,
    supervised_tokens,
    write_token_ids,
)
from automodel_llm.recipe import config_labels_shifted
from automodel_llm.row_seeds import RowSeeds, SeededSteps


def load_draft_weights(draft: LlamaForCausalLMEagle3, path: Path) -> bool:
    """Load a saved draft's weights into ``draft``; whether they carried its vocabulary."""
    weights = load_saved_draft(draft, path, "eagle3.draft_weights_path", "the target, draft_vocab_size, fc_norm "
                               "and P-EAGLE's num_draft_layers", optional=("d2t", "t2d"))
    return "d2t" in weights and "t2d" in weights


class Eagle3Recipe(SeededSteps, DraftRecipe):
    """Trains an EAGLE-3 draft (the run's model) against the frozen ``model`` section's target; with
    ``parallel_drafting`` a P-EAGLE one (:mod:`automodel_llm.eagle3.parallel`: its COD draws per row from the row's
    generator of the seed and step, as the block drafters' blocks)."""

    settings_key = "eagle3"
    loss_description = "EAGLE-3's soft cross entropy against the target's distribution"
    context_parallel_unsupported = ("the unroll shifts whole sequences each step, which context parallelism splits "
                                    "over ranks; use cp_size: 1")
    sections: ClassVar[dict] = {"eagle3": Eagle3Config, "recipe_args": RECIPE_ARGS}
    ttt_steps: int
    aux_layer_ids: list[int]

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        settings = cfg.get("eagle3")  # None: the section was refused (its issues are reported)
        if cfg.peft is not None and settings is not None and not settings.draft_weights_path:
            issues.append(ConfigIssue("peft", "LoRA adapts a trained draft: set eagle3.draft_weights_path (upstream's "
                                      "recipe_args.draft_weights_path) to the draft it adapts, whose weights and "
                                      "vocabulary the adapter is saved against; a fresh draft trains whole"))
        if settings is not None and settings.parallel_drafting:
            issues += cls.parallel_issues(cfg)
        text = cls.target_text_config(cfg)
        if settings is not None and text is not None:
            issues += cls.target_issues(settings, text)
        return issues

    @classmethod
    def parallel_issues(cls, cfg: Config) -> list[ConfigIssue]:
        """What P-EAGLE cannot run with (upstream refuses the same)."""
        issues = []
        if cfg.peft is not None:
            issues.append(ConfigIssue("peft", "P-EAGLE trains the draft whole (its placeholder state and embeddings "
                                      "with it), as upstream's: remove the section"))
        packing = cfg.get("packed_sequence")
        if packing is not None and (packing.enabled or packing.packed_sequence_size > 0):
            issues.append(ConfigIssue("packed_sequence.packed_sequence_size", "P-EAGLE's chains are drawn per row "
                                      "(packed samples would need them per sample, not built); set it 0"))
        return issues

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        settings = cfg.get("eagle3") or Eagle3Config()
        size = settings.draft_vocab_size or "the target's whole"
        layers = settings.aux_layer_ids or "[1, L/2 - 1, L - 4] of its L"
        drafting = (f"P-EAGLE: the model section is the frozen target; the trained model is a "
                    f"{settings.num_draft_layers}-layer draft reading the target's layers {layers}, drafting "
                    f"{settings.num_depths} tokens in one forward" if settings.parallel_drafting else
                    f"EAGLE-3: the model section is the frozen target; the trained model is a one-layer draft reading "
                    f"the target's layers {layers}, {settings.ttt_steps} unrolled steps")
        return [*super().describe_plan(cfg), f"{drafting}, a draft vocabulary of {size} tokens"]

    @classmethod
    def target_issues(cls, settings: Eagle3Config, text: Any) -> list[ConfigIssue]:
        issues = []
        layers, vocab = getattr(text, "num_hidden_layers", None), getattr(text, "vocab_size", None)
        if isinstance(layers, int):
            why = aux_layer_issue(settings.aux_layer_ids, layers)
            if why:
                issues.append(ConfigIssue("eagle3.aux_layer_ids", why))
        size = settings.draft_vocab_size
        if isinstance(vocab, int) and size is not None and size > vocab:
            issues.append(ConfigIssue("eagle3.draft_vocab_size", f"{size} is more than the target's {vocab} tokens"))
        mask = settings.mask_token_id
        if settings.parallel_drafting and isinstance(vocab, int) and isinstance(mask, int) and not mask < vocab:
            issues.append(ConfigIssue("eagle3.mask_token_id", f"{mask} is not a token of the target, whose "
                                      f"vocabulary holds {vocab} (0..{vocab - 1})"))
        return issues

    # ---- building ---------------------------------------------------------------------------------------------

    def build_model(self, ctx: BuildContext) -> torch.nn.Module:
        """The frozen target (kept as ``self.target``: :meth:`build_target`) and the draft made for it, which is what
        this returns: the run's model."""
        settings = self.settings()
        target = self.build_target(ctx)
        text = target.config.get_text_config()
        if why := aux_layer_issue(settings.aux_layer_ids, text.num_hidden_layers):  # a target validation could not read
            raise AutomodelError(f"eagle3.aux_layer_ids: {why}")
        self.aux_layer_ids = list(settings.aux_layer_ids or default_aux_layers(text.num_hidden_layers))
        self.ttt_steps = settings.ttt_steps
        size = settings.draft_vocab_size or text.vocab_size
        parallel = None
        if settings.parallel_drafting:
            parallel = {"num_hidden_layers": settings.num_draft_layers, "mask_token_id": settings.mask_token_id,
                        "num_depths": settings.num_depths, "down_sample_ratio": settings.down_sample_ratio,
                        "down_sample_ratio_min": settings.down_sample_ratio_min}
        config = draft_config(text, size, self.aux_layer_ids, settings.draft_attn_implementation, settings.fc_norm,
                              settings.norm_output, parallel)
        draft = LlamaForCausalLMEagle3(config)
        self.seeds = RowSeeds(self.cfg.rng.seed)
        self.share_embeddings(draft, settings.frozen_embeddings)
        if settings.draft_weights_path:
            with_vocabulary = load_draft_weights(draft, Path(settings.draft_weights_path))
            self.log(f"draft: started from the weights in {settings.draft_weights_path}"
                     + (" (their draft vocabulary too)" if with_vocabulary else ""))
        drafting = (f"P-EAGLE: a {settings.num_draft_layers}-layer draft drafting {settings.num_depths} tokens in one "
                    f"forward (COD ratio {settings.down_sample_ratio}, floor {settings.down_sample_ratio_min}, mask "
                    f"token {settings.mask_token_id})" if settings.parallel_drafting else
                    f"EAGLE-3: a one-layer draft, {self.ttt_steps} unrolled steps")
        self.log(f"{drafting} for the frozen target {self.target_class} ({text.num_hidden_layers} layers; the draft "
                 f"reads the outputs of layers {self.aux_layer_ids}), draft vocabulary {size} of {text.vocab_size} "
                 f"tokens, embeddings {'frozen' if settings.frozen_embeddings else 'trained'}")
        return draft

    def build_dataset(self, ctx: BuildContext, node: Any) -> Any:
        """The data set; the training one also sets the draft's vocabulary."""
        dataset = super().build_dataset(ctx, node)
        if node is not None and node.key == "dataset":
            self.choose_vocabulary(dataset)
        return dataset

    def choose_vocabulary(self, dataset: Any) -> None:
        """The draft vocabulary: the one of the weights ``draft_weights_path`` started the draft from, else the
        file ``selected_token_ids_path`` names when it exists, else the training data's most frequent label tokens.
        A given ``selected_token_ids_path`` that does not exist yet is then written (rank 0); one that exists must
        agree with warm-start weights. A resumed run's checkpoint restores the vocabulary it trained with over this."""
        draft: LlamaForCausalLMEagle3 = unwrap(self.model)
        settings = self.settings()
        size, vocab = draft.config.draft_vocab_size, draft.config.vocab_size
        path = Path(settings.selected_token_ids_path) if settings.selected_token_ids_path else None
        stored = read_token_ids(path, size, vocab) if path is not None and path.is_file() else None
        if bool(draft.t2d.any()):  # set already: by the saved draft draft_weights_path started from
            ids = draft.draft_token_ids().cpu()
            if stored is not None and not torch.equal(stored, ids):
                raise AutomodelError(f"eagle3.selected_token_ids_path: {path} is not the draft vocabulary of the "
                                     f"weights in {settings.draft_weights_path}: name the file their run wrote")
        elif stored is not None:
            ids = stored
            self.log(f"draft vocabulary: {size} tokens read from {path}")
        else:
            offset = 0 if config_labels_shifted(self.cfg) else 1
            ids = most_frequent_tokens((dataset[i] for i in range(len(dataset))), size, vocab, offset)
            self.log(f"draft vocabulary: the {size} most frequent label tokens of {len(dataset)} training samples")
        if path is not None and stored is None and self.is_main_process:
            write_token_ids(path, ids, vocab)
            self.log(f"draft vocabulary written to {path} (later runs read it)")
        draft.set_vocabulary(ids)

    # ---- the loss ---------------------------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """EAGLE-3's loss of the batch (summed over the drafted positions, as the engine's losses are); each
        unrolled step's is logged as ``loss_ttt<k>``, the validation's accuracy counted for
        :meth:`extra_validation_metrics`."""
        ids = batch["input_ids"]
        supervised = supervised_tokens(batch["labels"], self.label_offset).to(ids.device)
        out = self.run_target(batch)
        aux = torch.cat([out.hidden_states[i + 1] for i in self.aux_layer_ids], dim=-1)
        parallel = self.settings().parallel_drafting
        sums = model(input_ids=ids, supervised=supervised, aux_states=aux, target_logits=out.logits,
                     steps=self.ttt_steps, position_ids=batch.get("position_ids"),
                     elements=self.chains(batch, supervised)[0] if parallel else None)
        if model.training:
            for k, value in enumerate(sums.step_losses):
                self.add_loss_part(f"{'depth' if parallel else 'ttt'}{k}", value)
        else:
            self.count_for_validation(torch.stack([torch.stack(getattr(sums, name)) for name in
                                                   ("correct", "counted", "chain_hits", "chains")]))
        return sums.loss

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """EAGLE-3: the unroll's first step's slots; P-EAGLE: the counted elements of the rows' chains."""
        if not self.settings().parallel_drafting:
            return super().count_label_tokens(batch)
        supervised = supervised_tokens(batch["labels"], self.label_offset)
        elements, valid = self.chains(batch, supervised)
        return sum(int(counted_elements(v, *e).sum()) for e, v in zip(elements, valid, strict=True))

    def chains(self, batch: dict[str, torch.Tensor], supervised: torch.Tensor
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """P-EAGLE: each row's COD-sampled ``(anchors, depths)`` (on the host, from the row's generator) and its
        counted positions."""
        settings = self.settings()
        ids = batch["input_ids"].cpu()
        mask = batch.get("attention_mask")
        lengths = mask.sum(dim=1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
        elements, valid = [], []
        for row, length in enumerate(lengths):
            counted = reference_positions(supervised[row].cpu(), int(length))
            generator = self.seeds.generator(ids[row, :int(length)])
            elements.append(cod_elements(counted, settings.num_depths, settings.down_sample_ratio,
                                         settings.down_sample_ratio_min, generator))
            valid.append(counted)
        return elements, valid

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        """Over the validation set: ``accuracy`` (the draft's greedy token is the target's, over every step's
        counted slots), ``accuracy_ttt<k>`` per step (P-EAGLE: ``accuracy_depth<k>`` per depth), and
        ``accept_length``, the tokens one verification would accept under greedy chain drafting (``1 + sum_k P(the
        first k + 1 drafts are all right)``, upstream's simulated accept length; P-EAGLE's over the sampled chains)."""
        counts = self.validation_totals()
        if counts is None:
            return {}
        correct, counted, chain_hits, chains = counts
        metrics = {"accuracy": (correct.sum() / counted.sum().clamp_min(1)).item(),
                   "accept_length": (1 + (chain_hits / chains.clamp_min(1)).sum()).item()}
        kind = "depth" if self.settings().parallel_drafting else "ttt"
        metrics |= {f"accuracy_{kind}{k}": (correct[k] / counted[k].clamp_min(1)).item() for k in range(len(correct))}
        return metrics

    def final_message(self, model_dir: Path) -> str:
        if not model_dir.is_dir():  # saved sharded only: the base message says how to export it
            return super().final_message(model_dir)
        if (model_dir / "adapter_config.json").is_file():
            return (f"the LoRA adapter of the EAGLE-3 draft is in {model_dir}: `automodel export {model_dir.parent} "
                    "merged/` merges it into the draft it adapts (eagle3.draft_weights_path), which SGLang / vLLM "
                    "then serve")
        settings = self.settings()
        if settings.parallel_drafting:
            return (f"the P-EAGLE draft is in {model_dir} ({LlamaForCausalLMEagle3.__name__} with parallel_drafting, "
                    f"mask_hidden and {settings.num_draft_layers} layers): serve it with vLLM's parallel drafting, "
                    f"{settings.num_depths} speculative tokens (num_depths), mask token {settings.mask_token_id}")
        return (f"the EAGLE-3 draft is in {model_dir} ({LlamaForCausalLMEagle3.__name__}): serve it as the "
                f"speculative model of its target, e.g. vllm serve TARGET --speculative-config "
                f"'{{\"method\": \"eagle3\", \"model\": \"{model_dir}\", \"num_speculative_tokens\": "
                f"{self.ttt_steps}}}'")
