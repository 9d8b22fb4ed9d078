"""A cross-encoder that pools the backbone's token states and scores the pooled vector with one linear output.

Upstream NeMo AutoModel's reranker on a decoder (its ``pooling: avg | cls | last``): the backbone attends
bidirectionally (bidirectional.py), its last hidden states are pooled over the pair's real tokens, and a
``hidden_size -> 1`` linear layer without bias gives the score. Saved as a sentence-transformers 6 CrossEncoder
(st_format.write_st_cross_encoder_dir)::

    directory/
      config.json  model.safetensors  tokenizer files    the backbone (AutoModel; a decoder's says is_causal: false)
      modules.json  sentence_bert_config.json  config_sentence_transformers.json
      1_Pooling/config.json                              the pooling
      2_Dense/config.json  2_Dense/model.safetensors     the score layer (linear.weight [1, hidden_size])

so ``sentence_transformers.CrossEncoder(directory).predict(pairs)`` gives the same scores (through a sigmoid,
sentence-transformers' default for one-label rerankers), and ``CrossEncoder.from_pretrained`` here reloads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel_retrieval.models import POOLINGS, pool
from automodel_retrieval.st_format import DENSE_DIR, read_st_cross_encoder_dir, write_st_cross_encoder_dir

_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
BACKBONE, SCORE = "backbone.", "score."


class PooledCrossEncoder(nn.Module):
    """``backbone`` (a transformers base model) -> ``pooling`` (mean, cls, last) -> ``score`` (one logit).

    ``forward`` takes the tokenized pairs and returns an output whose ``logits`` are [B, 1], as
    AutoModelForSequenceClassification's, so the cross-encoder recipe treats both alike.
    """

    num_labels = 1

    def __init__(self, backbone: nn.Module, pooling: str = "mean", score: nn.Linear | None = None):
        super().__init__()
        if pooling not in POOLINGS:
            raise AutomodelError(f"model.pooling: '{pooling}' is not one of {', '.join(POOLINGS)}")
        self.backbone = backbone
        self.pooling = pooling
        hidden = backbone.config.hidden_size
        if score is None:
            weight = next(backbone.parameters())
            score = nn.Linear(hidden, 1, bias=False, device=weight.device, dtype=weight.dtype)
            nn.init.normal_(score.weight, std=getattr(backbone.config, "initializer_range", 0.02) or 0.02)
        self.score = score
        head = getattr(backbone, "pooler", None)  # BERT's own tanh head plays no part in the score: frozen
        if isinstance(head, nn.Module):
            head.requires_grad_(False)

    @property
    def config(self) -> Any:
        """The backbone's config (its vocabulary size, attention, ...)."""
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                **inputs: Any) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        if attention_mask is None:
            raise AutomodelError("the pooled cross-encoder needs the attention_mask of its inputs (to pool over the "
                                 "real tokens)")
        inputs = {k: v for k, v in inputs.items() if k in _INPUTS}
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        return SequenceClassifierOutput(logits=self.score(pool(hidden, attention_mask, self.pooling)))

    # ---- saving and loading -------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        tokenizer: Any = None, max_seq_length: int | None = None) -> None:
        """The layout of the module docstring; ``state_dict`` (the whole model's, e.g. gathered from FSDP2 ranks)
        is split between the backbone and the score layer."""
        from safetensors.torch import save_file

        directory = Path(str(directory))
        state = self.state_dict() if state_dict is None else state_dict
        backbone = {k.removeprefix(BACKBONE): v for k, v in state.items() if k.startswith(BACKBONE)}
        self.backbone.save_pretrained(str(directory), state_dict=backbone)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        (directory / DENSE_DIR).mkdir(parents=True, exist_ok=True)
        save_file({"linear.weight": state[f"{SCORE}weight"].detach().cpu().contiguous()},
                  str(directory / DENSE_DIR / "model.safetensors"))
        write_st_cross_encoder_dir(directory, pooling=self.pooling, hidden_size=self.config.hidden_size,
                                   max_seq_length=max_seq_length)

    def load_weights(self, directory: str | Path) -> None:
        """Copy the weights ``save_pretrained`` wrote into this model (keys and shapes must match)."""
        from automodel.training.checkpoint import load_safetensors_dir, load_weights_into

        directory = Path(str(directory))
        load_weights_into(self.backbone, load_safetensors_dir(directory), directory)
        self.load_score(directory)

    @classmethod
    def from_saved(cls, directory: str | Path, pooling: str | None = None, dtype: Any = None,
                   **kwargs: Any) -> PooledCrossEncoder:
        """Reload a directory ``save_pretrained`` wrote (``pooling``, when given, must be the saved one)."""
        from transformers import AutoModel

        from automodel.model_files import parse_dtype

        directory = Path(str(directory))
        saved = read_st_cross_encoder_dir(directory)
        if pooling is not None and pooling != saved:
            raise AutomodelError(f"model.pooling: '{pooling}', but the cross-encoder in '{directory}' was trained "
                                 f"with '{saved}' pooling; remove the key (or set {saved})")
        backbone = AutoModel.from_pretrained(str(directory), dtype=parse_dtype(dtype), **kwargs)
        model = cls(backbone, saved)
        model.load_score(directory)
        return model

    def load_score(self, directory: Path) -> None:
        """The score layer's weight from ``directory/2_Dense``."""
        from automodel.training.checkpoint import load_safetensors_dir, load_weights_into

        weight = load_safetensors_dir(directory / DENSE_DIR)["linear.weight"]
        load_weights_into(self.score, {"weight": weight.to(self.score.weight.dtype)}, directory / DENSE_DIR)
