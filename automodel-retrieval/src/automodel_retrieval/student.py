"""The distillation student: a bi-encoder plus a trainable linear projection into the teacher's embedding width.

The student's own embedding (what retrieval uses, and what the saved sentence-transformers model computes) is
the bi-encoder's pooled one; the projection exists only to compare it with a wider (or narrower) teacher's in the
cosine and MSE distillation losses. It is saved beside the bi-encoder (``distill_projection/``), which
``BiEncoder.from_pretrained`` and sentence-transformers ignore, so that a resumed run continues with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel_retrieval.models import BiEncoder

PROJECTION_DIR = "distill_projection"


def embedding_width(model: BiEncoder) -> int:
    """The width of ``model``'s embeddings (its encoders' hidden size)."""
    return int(model.encoder("query").config.hidden_size)


class ProjectedBiEncoder(BiEncoder):
    """A bi-encoder whose ``forward(..., projected=True)`` also returns its embeddings projected to
    ``projection_dim`` (``nn.Linear``, Xavier-initialised, zero bias); no projection (None) when the teacher has
    the student's width: the projected embeddings are then the embeddings themselves."""

    def __init__(self, query_encoder: nn.Module, document_encoder: nn.Module | None = None, pooling: str = "mean",
                 normalize: bool = True, input_settings: dict[str, Any] | None = None,
                 projection_dim: int | None = None):
        super().__init__(query_encoder, document_encoder, pooling, normalize, input_settings)
        self.projection: nn.Linear | None = None
        if projection_dim is not None:
            if projection_dim < 1:
                raise AutomodelError(f"model.teacher_hidden_size: must be >= 1, found {projection_dim}")
            self.projection = nn.Linear(embedding_width(self), projection_dim)
            nn.init.xavier_uniform_(self.projection.weight)
            nn.init.zeros_(self.projection.bias)

    @classmethod
    def around(cls, model: BiEncoder, projection_dim: int | None) -> ProjectedBiEncoder:
        """``model``'s encoders and settings, with a projection to ``projection_dim``."""
        return cls(model.query_encoder, None if model.shared else model.document_encoder, model.pooling,
                   model.normalize, model.input_settings, projection_dim)

    @property
    def projected_width(self) -> int:
        return self.projection.out_features if self.projection is not None else embedding_width(self)

    def project(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings if self.projection is None else self.projection(embeddings.float())

    def forward(self, query: dict[str, torch.Tensor] | None = None, document: dict[str, torch.Tensor] | None = None,
                projected: bool = False) -> tuple[torch.Tensor | None, ...]:
        """The embeddings ``(query, document)``; with ``projected`` also their projections
        ``(query, document, projected query, projected document)`` (computed here, inside the wrapped model's
        forward, so that data parallelism sees the projection's use)."""
        embedded = super().forward(query, document)
        if not projected:
            return embedded
        return (*embedded, *(None if e is None else self.project(e) for e in embedded))

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        tokenizer: Any = None, extra: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """The bi-encoder's layout, its projection in ``distill_projection/`` (``projection.weight`` / ``.bias``)."""
        from safetensors.torch import save_file

        state_dict = None if state_dict is None else dict(state_dict)
        projection = {k: state_dict.pop(k) for k in list(state_dict) if k.startswith("projection.")} \
            if state_dict is not None else {f"projection.{k}": v for k, v in self._projection_state().items()}
        super().save_pretrained(directory, state_dict=state_dict, tokenizer=tokenizer, extra=extra, **kwargs)
        if not projection:
            return
        where = Path(str(directory)) / PROJECTION_DIR
        where.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in projection.items()},
                  str(where / "projection.safetensors"))
        (where / "config.json").write_text(json.dumps({"in_features": embedding_width(self),
                                                       "out_features": self.projected_width}, indent=2) + "\n",
                                           encoding="utf-8")

    def _projection_state(self) -> dict[str, torch.Tensor]:
        return {} if self.projection is None else self.projection.state_dict()

    def load_weights(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        super().load_weights(directory)
        file = Path(str(directory)) / PROJECTION_DIR / "projection.safetensors"
        if self.projection is None:
            return
        if not file.is_file():
            raise AutomodelError(f"'{directory}' has no {PROJECTION_DIR}/projection.safetensors: it was not saved "
                                 "by the distillation recipe with a projection")
        state = {k.removeprefix("projection."): v for k, v in load_file(str(file)).items()}
        self.projection.load_state_dict(state)
