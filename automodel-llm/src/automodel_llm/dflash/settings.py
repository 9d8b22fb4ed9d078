"""The settings of DFlash draft training (the ``dflash:`` section) and of its variants: JetSpec's (``jetspec:``,
the same draft trained causally within a block towards the target's distributions), Domino's (``domino:``, with a
GRU correction head) and DFlash 2's (``dflash2:``, with dynamic convolutions and a path selector); and upstream's
``recipe_args:`` keys of its ``TrainDFlashRecipe`` / ``TrainJetSpecRecipe`` / ``TrainDominoRecipe`` /
``TrainDFlash2Recipe``, each standing for the key of the same meaning here or refused with the reason. Import-light:
no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from automodel.config import FieldErrors
from automodel_llm.draft_args import GPU_ONLY, draft_recipe_args

LOSS_TYPES = ("dflash", "variable_prefix")
ATTENTION = ("sdpa", "eager", "flex_attention")
PREFIX_WEIGHT_BASE = 0.9  # upstream's default


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass
class DFlashConfig:
    lowest_target_layer: ClassVar[int] = 0  # the lowest of target_layer_ids (DSpark's -1: the embeddings' output)

    mask_token_id: int | None = field(default=None, metadata={"help": (
        "required: the token filling a block's drafted slots (a reserved, otherwise unused id; not the pad token, "
        "often the end-of-text one). The serving engine fills the slots with the same id (saved in config.json)")})
    block_size: int = field(default=16, metadata={"help": (
        "tokens per drafted block: the anchor (a real token) and block_size - 1 drafted in one forward")})
    num_anchors: int = field(default=512, metadata={"help": (
        "blocks drawn per row and step: at most this many anchors among the row's label tokens that have a whole "
        "block after them")})
    draft_num_hidden_layers: int = field(default=5, metadata={"help": "decoder layers of the draft"})
    target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "the target layers (0-based; their outputs) the draft reads, concatenated (unset: upstream's even spread "
        "over layers 1 .. L-3 of L, one per draft layer)")})
    loss_decay_gamma: float | None = field(default=7.0, metadata={"help": (
        "drafted slot k (from 1) weighs exp(-(k - 1) / gamma) in the cross entropy (null: all equal); the paper's "
        "7 for blocks of 16, 5 for 10, 4 for 8")})
    loss_type: str = field(default="dflash", metadata={"help": (
        "dflash: the anchor alone is shown, slots 1.. are drafted; variable_prefix (D2SD's VP drafter): each block "
        "shows a drawn prefix of real tokens (2 .. block_size - 1, P(l) ~ prefix_weight_base^l) and drafts the rest, "
        "the decay counted from the prefix's end")})
    prefix_weight_base: float = field(default=PREFIX_WEIGHT_BASE, metadata={"help": (
        "variable_prefix: the base of the prefix lengths' geometric prior (below 1 favours short prefixes)")})
    attention_backend: str = field(default="sdpa", metadata={"help": (
        "the draft's attention: sdpa or eager (the same numbers), or flex_attention (torch's compiled block-sparse "
        "kernel, the same numbers; needs a CUDA GPU)")})
    draft_sliding_window: int | None = field(default=None, metadata={"help": (
        "a drafted slot reads the target's states of at most this many positions back (layers saved as "
        "sliding_attention; unset: the whole prefix)")})
    draft_num_attention_heads: int | None = field(default=None, metadata={"help": (
        "the draft's attention heads (unset: the target's)")})
    draft_num_key_value_heads: int | None = field(default=None, metadata={"help": (
        "the draft's key/value heads (unset: the target's)")})
    draft_head_dim: int | None = field(default=None, metadata={"help": "the draft's head size (unset: the target's)"})
    target_force_hf: bool = field(default=True, metadata={"help": (
        "upstream's choice of transformers' class for the target over its own: true only (the target here is "
        "transformers' class)")})
    draft_weights_path: str | None = field(default=None, metadata={"help": (
        "start the draft from a saved one of the same kind: its model/ directory (a run's here, or a published "
        "drafter's: config.json and safetensors, read with this build's class, no remote code) or one .safetensors "
        "file; its block size, mask token and target layers (from its config.json) and its sizes must be this "
        "run's")})

    def __post_init__(self) -> None:
        errors = {}
        if self.mask_token_id is None:
            errors["mask_token_id"] = ("required: the id of a reserved, otherwise unused token that fills the "
                                       "drafted slots (e.g. 151669 for Qwen3); not the pad token, which is often "
                                       "the end-of-text one")
        elif not _whole(self.mask_token_id, 0):
            errors["mask_token_id"] = f"expected a token id >= 0, found {self.mask_token_id!r}"
        for name, least in (("block_size", 2), ("num_anchors", 1), ("draft_num_hidden_layers", 1)):
            if not _whole(getattr(self, name), least):
                errors[name] = f"expected a whole number >= {least}, found {getattr(self, name)!r}"
        for name in ("draft_sliding_window", "draft_num_attention_heads", "draft_num_key_value_heads",
                     "draft_head_dim"):
            value = getattr(self, name)
            if value is not None and not _whole(value, 1):
                errors[name] = f"expected a whole number >= 1 or null, found {value!r}"
        ids = self.target_layer_ids
        lowest = self.lowest_target_layer
        if ids is not None and (not isinstance(ids, list) or not ids or not all(_whole(i, lowest) for i in ids)):
            errors["target_layer_ids"] = f"expected a list of layer indices >= {lowest}, found {ids!r}"
        if self.loss_decay_gamma is not None and not _positive(self.loss_decay_gamma):
            errors["loss_decay_gamma"] = f"expected a number > 0 or null, found {self.loss_decay_gamma!r}"
        if self.loss_type not in LOSS_TYPES:
            errors["loss_type"] = f"expected one of {', '.join(LOSS_TYPES)}, found {self.loss_type!r}"
        if not _positive(self.prefix_weight_base):
            errors["prefix_weight_base"] = f"expected a number > 0, found {self.prefix_weight_base!r}"
        elif self.loss_type == "dflash" and self.prefix_weight_base != PREFIX_WEIGHT_BASE:
            errors["prefix_weight_base"] = (f"{self.prefix_weight_base!r}: only loss_type variable_prefix draws "
                                            "prefixes (the dflash loss shows each block its anchor alone); remove "
                                            "it or set loss_type: variable_prefix")
        if self.attention_backend not in ATTENTION:
            errors["attention_backend"] = f"expected one of {', '.join(ATTENTION)}, found {self.attention_backend!r}"
        if self.target_force_hf is not True:
            errors["target_force_hf"] = (f"{self.target_force_hf!r}: upstream's own target model classes are not "
                                         "built here; the target is transformers' class (true)")
        errors.update(self.variant_errors())
        if errors:
            raise FieldErrors(errors)

    def variant_errors(self) -> dict[str, str]:
        """What is wrong with a variant's own keys (a variant's section overrides this)."""
        return {}


@dataclass
class JetSpecConfig(DFlashConfig):
    """DFlash's settings less its loss's (JetSpec's loss is the forward KL against the target's distributions,
    uniform over the drafted slots), with the distillation's."""

    loss_decay_gamma: float | None = field(default=None, metadata={"help": (
        "null only: JetSpec weighs every drafted slot alike")})
    kd_temperature: float = field(default=1.0, metadata={"help": (
        "the temperature of the target's and the draft's distributions in the forward KL (scaled by its square)")})
    kd_chunk_size: int = field(default=0, metadata={"help": (
        "above 0: the drafted slots' float32 distributions are computed this many at a time (less memory, the "
        "same loss); 0: all at once")})

    def variant_errors(self) -> dict[str, str]:
        errors = {}
        if self.loss_decay_gamma is not None:
            errors["loss_decay_gamma"] = (f"{self.loss_decay_gamma!r}: JetSpec's forward KL weighs every drafted slot "
                                          "alike; remove it (null)")
        if self.loss_type != "dflash":
            errors["loss_type"] = (f"{self.loss_type!r}: JetSpec's blocks show their anchor alone (its loss is the "
                                   "forward KL against the target); remove it")
        if not _positive(self.kd_temperature):
            errors["kd_temperature"] = f"expected a number > 0, found {self.kd_temperature!r}"
        if not _whole(self.kd_chunk_size, 0):
            errors["kd_chunk_size"] = f"expected a whole number >= 0, found {self.kd_chunk_size!r}"
        return errors


@dataclass
class DominoConfig(DFlashConfig):
    """DFlash's settings (the dflash loss only) with Domino's correction head and its curriculum."""

    emb_dim: int = field(default=256, metadata={"help": "the correction head's low-rank width"})
    gru_hidden_dim: int = field(default=1024, metadata={"help": (
        "the width of the GRU that reads a block's earlier tokens (its state conditions the correction)")})
    pure_draft_prefix_len: int = field(default=1, metadata={"help": (
        "a block's first drafting slots that keep the backbone's logits uncorrected")})
    shift_label: bool = field(default=True, metadata={"help": (
        "true (Domino's): slot k drafts the token at anchor + 1 + k, the anchor's slot drafting too; false: "
        "DFlash's slots (k drafts anchor + k, slot 0 drafts nothing)")})
    lambda_base_start: float = field(default=1.0, metadata={"help": (
        "the weight of the backbone-only logits' loss at step 0 (the corrected logits' weighs 1 - it)")})
    lambda_base_decay_ratio: float = field(default=0.5, metadata={"help": (
        "the share of the run's steps over which that weight falls linearly to 0")})

    def variant_errors(self) -> dict[str, str]:
        errors = {}
        for name, least in (("emb_dim", 1), ("gru_hidden_dim", 1), ("pure_draft_prefix_len", 0)):
            if not _whole(getattr(self, name), least):
                errors[name] = f"expected a whole number >= {least}, found {getattr(self, name)!r}"
        if not isinstance(self.shift_label, bool):
            errors["shift_label"] = f"expected true or false, found {self.shift_label!r}"
        if self.loss_type != "dflash":
            errors["loss_type"] = (f"{self.loss_type!r}: Domino's blocks show their anchor alone (its correction "
                                   "reads the block's earlier tokens); remove it")
        if not isinstance(self.lambda_base_start, (int, float)) or not 0 <= self.lambda_base_start <= 1:
            errors["lambda_base_start"] = f"expected a number in [0, 1], found {self.lambda_base_start!r}"
        if not _positive(self.lambda_base_decay_ratio):
            errors["lambda_base_decay_ratio"] = f"expected a number > 0, found {self.lambda_base_decay_ratio!r}"
        first = self.pure_draft_prefix_len if self.shift_label else 1 + self.pure_draft_prefix_len
        if _whole(self.pure_draft_prefix_len, 0) and _whole(self.block_size, 2) and first >= self.block_size:
            errors["pure_draft_prefix_len"] = (f"{self.pure_draft_prefix_len}: leaves no slot of a block of "
                                               f"{self.block_size} to correct")
        return errors

    @property
    def correction_start(self) -> int:
        """The first block slot the correction head acts on."""
        return self.pure_draft_prefix_len if self.shift_label else 1 + self.pure_draft_prefix_len


@dataclass
class DFlash2Config(DFlashConfig):
    """DFlash's settings (the dflash loss only) with DFlash 2's convolutions and path selector."""

    conv_kernel_size: int = field(default=2, metadata={"help": (
        "taps of the dynamic convolution around each sublayer (2: a slot and the one before it in its block)")})
    conv_group_size: int = field(default=16, metadata={"help": (
        "channels sharing one dynamic tap (must divide the hidden size)")})
    selector_rank: int = field(default=256, metadata={"help": "the width of the path selector's token codebooks"})
    selector_top_k: int = field(default=16, metadata={"help": "candidates the selector scores at each slot"})
    selector_loss_weight: float = field(default=1.0, metadata={"help": (
        "the weight of the selector's cross entropy (over each slot's candidates, after the true predecessor) "
        "beside the block's")})

    def variant_errors(self) -> dict[str, str]:
        errors = {}
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if not _whole(getattr(self, name), 1):
                errors[name] = f"expected a whole number >= 1, found {getattr(self, name)!r}"
        weight = self.selector_loss_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            errors["selector_loss_weight"] = f"expected a number >= 0, found {weight!r}"
        if self.loss_type != "dflash":
            errors["loss_type"] = (f"{self.loss_type!r}: DFlash 2's blocks show their anchor alone (its selector "
                                   "follows the drafted path from it); remove it")
        return errors


MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclass
class DSparkConfig(DFlashConfig):
    """DFlash's settings (the dflash loss only; upstream's DSpark recipe's defaults) with DSpark's serial Markov head,
    its confidence head and its three-term loss."""

    lowest_target_layer: ClassVar[int] = -1

    block_size: int = field(default=7, metadata={"help": (
        "tokens drafted per block: the anchor's slot drafts the token after it, so a block drafts block_size tokens")})
    loss_decay_gamma: float | None = field(default=None, metadata={"help": (
        "drafted slot k (from 0: the anchor's) weighs exp(-k / gamma) in every term of the loss (null, upstream's "
        "default: all equal; the published DSpark drafters use 4)")})
    target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "the target layers (0-based; their outputs; -1: the embeddings') the draft reads, concatenated (unset: "
        "upstream's DSpark default, one per draft layer spread evenly over layers 1 .. L-1 of L)")})
    markov_rank: int = field(default=256, metadata={"help": (
        "the Markov head's rank: the previous token's low-rank embedding projected to a bias of the slot's logits "
        "(0: no Markov head, the blocks' drafts independent)")})
    markov_head_type: str = field(default="vanilla", metadata={"help": (
        "vanilla (the bias from the previous token alone), gated (gated by the slot's state) or rnn (a recurrent "
        "state over the block's earlier tokens)")})
    confidence_head_alpha: float = field(default=1.0, metadata={"help": (
        "the weight of the confidence head's loss (above 0: the head is built; it predicts each drafted token's "
        "acceptance probability, 1 - half the L1 distance of the draft's and the target's distributions)")})
    confidence_head_with_markov: bool = field(default=True, metadata={"help": (
        "the confidence head also reads the Markov head's embedding of the previous token (needs markov_rank > 0)")})
    ce_loss_alpha: float = field(default=0.1, metadata={"help": (
        "the weight of the drafted tokens' cross entropy against the data's tokens")})
    l1_loss_alpha: float = field(default=0.9, metadata={"help": (
        "the weight of the L1 distance between the draft's and the target's distributions of each drafted token")})
    freeze_embeddings: bool = field(default=True, metadata={"help": (
        "the draft's embeddings and output head (copies of the target's, saved with it) stay frozen; false trains "
        "them")})
    shard_dense_target: bool | None = field(default=None, metadata={"help": (
        "unset: the target is split as the draft is (FSDP2 under strategy fsdp2, whole under ddp); true: FSDP2 "
        "splits it (needs strategy fsdp2); false: it stays whole on every rank (upstream's default)")})

    def variant_errors(self) -> dict[str, str]:
        errors = {}
        if not _whole(self.markov_rank, 0):
            errors["markov_rank"] = f"expected a whole number >= 0, found {self.markov_rank!r}"
        if self.markov_head_type not in MARKOV_HEADS:
            errors["markov_head_type"] = f"expected one of {', '.join(MARKOV_HEADS)}, found {self.markov_head_type!r}"
        for name in ("confidence_head_alpha", "ce_loss_alpha", "l1_loss_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                errors[name] = f"expected a number >= 0, found {value!r}"
        for name in ("confidence_head_with_markov", "freeze_embeddings"):
            if not isinstance(getattr(self, name), bool):
                errors[name] = f"expected true or false, found {getattr(self, name)!r}"
        if self.shard_dense_target not in (None, True, False):
            errors["shard_dense_target"] = f"expected true, false or null, found {self.shard_dense_target!r}"
        if self.confidence_head_with_markov is True and self.markov_rank == 0 and self.confidence_head_alpha:
            errors["confidence_head_with_markov"] = ("true reads the Markov head's embedding, and markov_rank 0 builds "
                                                     "none: set it false or markov_rank above 0")
        if self.loss_type != "dflash":
            errors["loss_type"] = (f"{self.loss_type!r}: DSpark's blocks show their anchor alone; remove it")
        weights = (self.ce_loss_alpha, self.l1_loss_alpha, self.confidence_head_alpha)
        if all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights) and not any(weights):
            errors["ce_loss_alpha"] = "ce_loss_alpha, l1_loss_alpha and confidence_head_alpha are all 0: nothing trains"
        return errors

    @property
    def confidence_head(self) -> bool:
        """Whether the draft has a confidence head."""
        return self.confidence_head_alpha > 0


def default_target_layers(layers: int, draft_layers: int) -> list[int]:
    """Upstream's feature layers of a target of ``layers`` layers for a draft of ``draft_layers``: the middle one
    for a one-layer draft, else ``draft_layers`` spread evenly over layers 1 .. ``layers - 3``."""
    if draft_layers == 1:
        return [layers // 2]
    start, end = 1, layers - 3
    return [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]


def spark_target_layers(layers: int, draft_layers: int) -> list[int]:
    """Upstream's DSpark feature layers of a target of ``layers`` layers for a draft of ``draft_layers``: the last
    for one, else ``draft_layers`` (at most ``layers - 1``) spread evenly over layers 1 .. ``layers - 1``."""
    count = max(1, min(draft_layers, layers - 1))
    last = layers - 1
    if count == 1:
        return [last]
    step = (last - 1) / (count - 1)
    return sorted({round(1 + i * step) for i in range(count)})


def target_layer_issue(ids: list[int] | None, layers: int, draft_layers: int,
                       default: Callable[[int, int], list[int]] = default_target_layers, lowest: int = 0) -> str | None:
    """What is wrong with the feature layers ``ids`` (None: ``default``'s, upstream's) for a target of ``layers``
    layers (``lowest`` and up: -1 the embeddings' output); None when nothing is."""
    chosen = ids if ids is not None else default(layers, draft_layers)
    if all(lowest <= i < layers for i in chosen):
        return None
    if ids is not None:
        return f"{ids}: the target has {layers} layers ({lowest}..{layers - 1})"
    return (f"unset, and the default {chosen} does not fit a target of {layers} layers: name the layers "
            f"(0..{layers - 1}) the draft reads")


def flex_attention_issue(cuda: bool) -> str | None:
    """Why ``attention_backend: flex_attention`` cannot run (None: it can)."""
    if cuda:
        return None
    return (f"flex_attention {GPU_ONLY} (torch compiles its block-sparse kernel there; uncompiled it has no backward "
            "pass); use sdpa, which computes the same attention")


_DRAFT_KEYS = ("mask_token_id", "block_size", "num_anchors", "draft_num_hidden_layers", "target_layer_ids",
               "attention_backend", "draft_sliding_window", "draft_num_attention_heads", "draft_num_key_value_heads",
               "draft_head_dim", "target_force_hf")
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_weight")
_VARIANTS = dict.fromkeys(_DFLASH2_KEYS, "DFlash 2's convolution and path selector: recipe: TrainDFlash2Recipe "
                                         "(automodel finetune dflash2) trains them")
_DOMINO_KEYS = ("emb_dim", "gru_hidden_dim", "pure_draft_prefix_len", "shift_label", "lambda_base_start",
                "lambda_base_decay_ratio")
_DOMINO_HEAD = "Domino's correction head: recipe: TrainDominoRecipe (automodel finetune domino) trains it"
# upstream's TrainDFlashRecipe / TrainJetSpecRecipe recipe_args: each key -> the key it stands for here, or why refused
_NOT_THIS_HEAD = {**_VARIANTS, **dict.fromkeys(("projector_type", *_DOMINO_KEYS), _DOMINO_HEAD)}
RECIPE_ARGS = draft_recipe_args("TrainDFlashRecipe", "dflash",
                                (*_DRAFT_KEYS, "loss_decay_gamma", "loss_type", "prefix_weight_base"), _NOT_THIS_HEAD)
JETSPEC_RECIPE_ARGS = draft_recipe_args("TrainJetSpecRecipe", "jetspec",
                                        (*_DRAFT_KEYS, "loss_decay_gamma", "kd_temperature", "kd_chunk_size"),
                                        _NOT_THIS_HEAD)
DFLASH2_RECIPE_ARGS = draft_recipe_args(
    "TrainDFlash2Recipe", "dflash2", (*_DRAFT_KEYS, "loss_decay_gamma", "loss_type", *_DFLASH2_KEYS),
    dict.fromkeys(("projector_type", *_DOMINO_KEYS), _DOMINO_HEAD))
_DSPARK_KEYS = ("markov_rank", "markov_head_type", "confidence_head_alpha", "confidence_head_with_markov",
                 "ce_loss_alpha", "l1_loss_alpha", "freeze_embeddings", "shard_dense_target")
DSPARK_RECIPE_ARGS = draft_recipe_args(
    "TrainDSparkRecipe", "dspark", (*_DRAFT_KEYS, "loss_decay_gamma", *_DSPARK_KEYS),
    {**_NOT_THIS_HEAD, **dict.fromkeys(("cache_output_dir", "cache_shard_size", "cache_dtype"), (
        "a key of upstream's offline precompute script (the target's supervision written to disk), which is not "
        "built here: the target runs beside the draft; remove it"))},
    keys={"chat_template": ("dataset.chat_template", "validation_dataset.chat_template"),
          "target_num_hidden_layers": "model.num_hidden_layers"})
DOMINO_RECIPE_ARGS = draft_recipe_args(
    "TrainDominoRecipe", "domino", (*_DRAFT_KEYS, "loss_decay_gamma", "loss_type", *_DOMINO_KEYS),
    {**_VARIANTS, "projector_type": "the head is Domino's in this recipe (projector_type domino): remove it"})
