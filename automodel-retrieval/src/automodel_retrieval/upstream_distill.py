"""Upstream NeMo AutoModel's embedding-distillation names, on this package's models and collator.

``RetrieverStudentWithProjection.build`` / ``RetrieverTeacherEmbeddingEncoder.build`` (a private module path
upstream; the plugin's aliases lead its names here) and ``BiEncoderDistillCollator``, with upstream's keyword
arguments. What cannot act here (intermediate-layer capture, cached teacher embeddings) is refused with the reason.
"""

from __future__ import annotations

from typing import Any

from automodel.errors import ConfigIssue
from automodel_retrieval.upstream import UpstreamBiEncoderCollator, _refuse, bi_encoder_from_pretrained

_HERE = "automodel_retrieval.upstream_distill"
ENCODERS = (f"{_HERE}.student_from_pretrained", f"{_HERE}.teacher_from_pretrained")


def distill_issues(settings: dict[str, Any], key: str = "model") -> list[ConfigIssue]:
    """The distillation keys of upstream's student / teacher that cannot act here."""
    issues = []
    if settings.get("capture_layers"):
        issues.append(ConfigIssue(f"{key}.capture_layers", "capturing intermediate layers serves upstream's "
                                  "intermediate-layer loss, which is not implemented here; remove it (or give [])"))
    width = settings.get("teacher_hidden_size")
    if key == "model" and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        issues.append(ConfigIssue(f"{key}.teacher_hidden_size", f"expected the teacher's embedding width (an "
                                  f"integer >= 1), found {width!r}"))
    return issues


def student_from_pretrained(pretrained_model_name_or_path: str, teacher_hidden_size: int, pooling: str = "avg",
                            l2_normalize: bool = False, capture_layers: list[int] | None = None,
                            trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """Upstream's distillation student: its bi-encoder (``NeMoAutoModelBiEncoder.from_pretrained``'s arguments,
    one shared encoder) with a linear projection to ``teacher_hidden_size``."""
    from automodel_retrieval.student import ProjectedBiEncoder

    _refuse(distill_issues({"capture_layers": capture_layers, "teacher_hidden_size": teacher_hidden_size}))
    model = bi_encoder_from_pretrained(pretrained_model_name_or_path, pooling=pooling, l2_normalize=l2_normalize,
                                       trust_remote_code=trust_remote_code, **kwargs)
    return ProjectedBiEncoder.around(model, teacher_hidden_size)


def teacher_from_pretrained(pretrained_model_name_or_path: str, pooling: str = "avg", l2_normalize: bool = False,
                            capture_layers: list[int] | None = None, trust_remote_code: bool = False,
                            **kwargs: Any) -> Any:
    """Upstream's frozen distillation teacher: its bi-encoder (the recipe freezes it and keeps it in eval)."""
    _refuse(distill_issues({"capture_layers": capture_layers}, "teacher_model"))
    return bi_encoder_from_pretrained(pretrained_model_name_or_path, pooling=pooling, l2_normalize=l2_normalize,
                                      trust_remote_code=trust_remote_code, **kwargs)


def collator_issues(settings: dict[str, Any], key: str = "dataloader.collate_fn") -> list[ConfigIssue]:
    if settings.get("teacher_embeddings_cache"):
        return [ConfigIssue(f"{key}.teacher_embeddings_cache", "cached teacher embeddings are not implemented "
                                                               "here: the teacher embeds each batch; remove it")]
    if settings.get("teacher_cache_lookup_with_prefixes"):
        return [ConfigIssue(f"{key}.teacher_cache_lookup_with_prefixes", "governs the lookup in cached teacher "
                                                                          "embeddings, which are not implemented "
                                                                          "here; remove it")]
    return []


class UpstreamBiEncoderDistillCollator(UpstreamBiEncoderCollator):
    """Upstream's BiEncoderDistillCollator: its bi-encoder collator's arguments (the batch is the bi-encoder
    recipe's; the teacher embeds the same tokens)."""

    def __init__(self, tokenizer: Any = None, q_max_len: int = 512, p_max_len: int = 512, query_prefix: str = "",
                 passage_prefix: str = "", padding: bool | str = True, pad_to_multiple_of: int | None = None,
                 use_dataset_instruction: bool = False, teacher_embeddings_cache: str | None = None,
                 teacher_cache_lookup_with_prefixes: bool = False):
        _refuse(collator_issues({"teacher_embeddings_cache": teacher_embeddings_cache,
                                 "teacher_cache_lookup_with_prefixes": teacher_cache_lookup_with_prefixes}))
        super().__init__(tokenizer, q_max_len, p_max_len, query_prefix, passage_prefix, padding, pad_to_multiple_of,
                         use_dataset_instruction)
