"""Next-token-prediction recipe for fine-tuning and pre-training causal LMs, on the core's shared loop."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel.config import Target
from automodel.errors import AutomodelError
from automodel.hf import (
    EvalGenerationConfig,
    check_vocab,
    exact_match,
    is_adapter_dir,
    load_adapter_weights,
    load_tokenizer,
    missing_local_path,
    model_source,
)
from automodel.training.context import BuildContext
from automodel.training.modules import unwrap
from automodel.training.next_token import NextTokenLogits
from automodel.training.recipe import TrainRecipe
from automodel_llm.datasets.collate import pad_collate
from automodel_llm.datasets.packing import PackedDataset, packed_collate

IGNORE_INDEX = -100
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


@dataclass
class PackedSequenceConfig:
    enabled: bool = field(default=False, metadata={"help": "pack several samples into each row"})
    packed_sequence_size: int = field(default=0, metadata={"help": "tokens per packed row (0: packing off)"})
    split_across_pack: bool = field(default=False, metadata={"help": "let a sample continue in the next row"})
    max_packs: int | None = field(default=None, metadata={"help": "stop after this many packed rows"})


class FinetuneRecipeForNextTokenPrediction(NextTokenLogits, TrainRecipe):
    """Causal LM training: loss on label tokens (answers for SFT, everything for pre-training)."""

    domain = "llm"
    sections = {
        "tokenizer": Target("tokenizer (default: the model's): {pretrained_model_name_or_path: ...}", plain=True,
                            default_target="transformers.AutoTokenizer.from_pretrained"),
        "dataset": Target("the training data set", required=True, runtime_args=("tokenizer",)),
        "validation_dataset": Target("a validation data set", runtime_args=("tokenizer",)),
        "validation_dataset_*": Target("more validation data sets, reported by name", runtime_args=("tokenizer",)),
        "packed_sequence": PackedSequenceConfig,
        "eval_generation": EvalGenerationConfig,
    }

    # ---- building -------------------------------------------------------------------------------------------

    def _tokenizer_source(self) -> tuple[str | None, str]:
        found = model_source(self.cfg.model)
        if found is not None:
            value, key = found
            return (str(Path(value).parent) if Path(value).is_file() else value), key
        dataset = self.cfg.dataset
        if isinstance(dataset.get("tokenizer_name_or_path"), str):
            return dataset["tokenizer_name_or_path"], "dataset.tokenizer_name_or_path"
        return None, "tokenizer"

    def setup_domain(self) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # our own progress bar is the one to watch
        node = self.cfg.tokenizer
        if node is not None:
            source = node.get("pretrained_model_name_or_path")
            if node.target is None and missing_local_path(source):
                raise AutomodelError(f"tokenizer.pretrained_model_name_or_path: '{source}' does not exist")
            self.tokenizer = node.instantiate(default_target="transformers.AutoTokenizer.from_pretrained")
        else:
            source, key = self._tokenizer_source()
            if source is None:
                raise AutomodelError("tokenizer: none found; add `tokenizer: {pretrained_model_name_or_path: ...}`")
            self.tokenizer = load_tokenizer(source, key)
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token_id is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def dataset_runtime_args(self, node: Any) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer}

    def collate_runtime_args(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer}

    @property
    def pack_size(self) -> int | None:
        packing = self.cfg.packed_sequence
        if packing is None or not (packing.enabled or packing.packed_sequence_size > 0):
            return None
        if packing.packed_sequence_size < 2:
            raise AutomodelError("packed_sequence.packed_sequence_size: set it (tokens per packed row) when "
                                 "packed_sequence.enabled is true")
        return packing.packed_sequence_size

    def build_dataset(self, ctx: BuildContext, node: Any) -> Any:
        dataset = super().build_dataset(ctx, node)
        if node is not None and node.key == "dataset" and self.pack_size:
            packing = self.cfg.packed_sequence
            dataset = PackedDataset(dataset, self.pack_size, packing.split_across_pack, packing.max_packs)
            self.log(f"packed the training data into {len(dataset)} rows of {self.pack_size} tokens")
        return dataset

    def default_collate_fn(self, train: bool = True) -> Any:
        pad = self.tokenizer.pad_token_id or 0
        if train and self.pack_size:
            return functools.partial(packed_collate, pack_size=self.pack_size, pad_token_id=pad)
        return functools.partial(pad_collate, pad_token_id=pad)

    def setup(self) -> None:
        super().setup()
        check_vocab(self.tokenizer, getattr(unwrap(self.model), "config", None),
                    "tokenizer: {tokens} tokens but model.config.vocab_size is {vocab}; use the model's own "
                    "tokenizer or resize the model's embeddings")

    def load_model_weights(self, model: torch.nn.Module, directory: Path) -> None:
        if is_adapter_dir(directory):
            load_adapter_weights(model, directory)
        else:
            super().load_model_weights(model, directory)

    # ---- the loss ---------------------------------------------------------------------------------------------

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in batch.items() if k in MODEL_INPUTS}, "use_cache": False}

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss_fn(*self.next_token_logits(model, batch, self.head_positions))

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def count_input_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Non-padding tokens (what tokens/s counts)."""
        if "token_count" in batch:
            return int(batch["token_count"].sum())
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else batch["input_ids"].numel()

    # ---- after training ------------------------------------------------------------------------------------

    def final_message(self, model_dir: Path) -> str:
        if (model_dir / "adapter_config.json").is_file():
            return (f"Trained LoRA adapter in {model_dir}: load it with peft.PeftModel.from_pretrained(base_model, "
                    f"'{model_dir}'), or merge it with `automodel export {model_dir.parent} merged/`")
        return (f"Trained model in {model_dir}: load it with transformers.AutoModelForCausalLM.from_pretrained("
                f"'{model_dir}') and AutoTokenizer.from_pretrained('{model_dir}')")

    def _generation_pairs(self) -> list[tuple[str, str]]:
        for loader in self.val_dataloaders.values():
            pairs = getattr(loader.dataset, "qa_pairs", None)
            if pairs:
                return list(pairs)
        return []

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        settings = self.cfg.eval_generation
        pairs = self._generation_pairs()
        if settings is not None and settings.enabled and pairs and self.is_main_process and \
                "eval_generation" in self.cfg:
            pairs = pairs[: settings.num_examples] if settings.num_examples else pairs
            score, results = exact_match(unwrap(self.model), self.tokenizer, pairs, settings.max_new_tokens,
                                         self.device)
            for prompt, expected, got in results[: settings.num_shown]:
                self.log(f"  Q: {prompt}\n     expected: {expected!r}  model: {got!r}")
            self.log(f"exact match on {len(results)} validation questions: {score:.3f}")
            if final_checkpoint is not None:
                record = {"step": self.step_scheduler.step, "exact_match": score, "num_questions": len(results)}
                with open(Path(self.cfg.checkpoint.checkpoint_dir) / "eval_generation.json", "w") as f:
                    json.dump(record, f)
        if final_checkpoint is not None:
            model_dir = final_checkpoint / "model"
            self.log(self.final_message(model_dir))
