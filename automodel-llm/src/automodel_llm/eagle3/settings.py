"""The settings of EAGLE-3 draft training: the ``eagle3:`` section, and upstream's ``recipe_args:`` keys, each
standing for the key of the same meaning here or refused with the reason. Import-light: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from automodel.config import FieldErrors
from automodel_llm.draft_args import GPU_ONLY, NOT_BUILT, draft_recipe_args

ATTENTION = ("eager", "sdpa")  # the draft attentions built here (both give the same numbers)


@dataclass
class Eagle3Config:
    ttt_steps: int = field(default=7, metadata={"help": (
        "steps of the training-time-test unroll: the draft learns to draft that many tokens ahead, feeding itself "
        "its own hidden states (step k weighs 0.8^k)")})
    draft_vocab_size: int | None = field(default=None, metadata={"help": (
        "tokens the draft predicts: the training data's most frequent label tokens (unset: the target's whole "
        "vocabulary)")})
    aux_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "the three target layers (0-based; their outputs) the draft reads (unset: [1, L/2 - 1, L - 4] of L layers, "
        "upstream's default)")})
    freeze_embeddings: bool | None = field(default=None, metadata={"help": (
        "the draft's token embeddings, copied from the target, stay frozen (false: trained; unset: frozen for "
        "EAGLE-3, trained for P-EAGLE, upstream's defaults)")})
    selected_token_ids_path: str | None = field(default=None, metadata={"help": (
        "a file of the draft vocabulary (JSON, whatever its name): read when it exists (its sizes must match), else "
        "written from the data's counts, so later runs skip the count (delete it when the data changes)")})
    draft_weights_path: str | None = field(default=None, metadata={"help": (
        "start the draft from a saved one: a draft's model/ directory (or one .safetensors file) of the same "
        "sizes, also in upstream's form checkpoint_dir/LATEST/model/consolidated; its d2t / t2d, when it has them, "
        "are the draft vocabulary")})
    target_force_hf: bool = field(default=True, metadata={"help": (
        "upstream's choice of transformers' class for the target over its own: true only (the target here is "
        "transformers' class)")})
    draft_attn_implementation: str = field(default="eager", metadata={"help": (
        "the draft's attention: eager or sdpa (the same numbers); flash_attention_2 needs a CUDA GPU")})
    cp_zigzag: bool = field(default=False, metadata={"help": (
        "upstream's load-balanced layout of the draft's sequence over context-parallel ranks: false only (the draft "
        "runs on whole sequences here, distributed.cp_size 1)")})
    fc_norm: bool = field(default=False, metadata={"help": (
        "EAGLE-3.1: an RMSNorm on each of the three target states before they are fused")})
    norm_output: bool = field(default=False, metadata={"help": (
        "EAGLE-3.1: the state a step carries to the next is the normed one")})
    parallel_drafting: bool = field(default=False, metadata={"help": (
        "P-EAGLE: the draft drafts num_depths tokens in one forward (masked slots after the first: mask_token_id "
        "and a learned placeholder state, mask_hidden), trained on COD-sampled chains instead of the unroll")})
    num_depths: int = field(default=8, metadata={"help": (
        "P-EAGLE: tokens drafted in one forward (vLLM's num_speculative_tokens at serving)")})
    num_draft_layers: int = field(default=1, metadata={"help": (
        "P-EAGLE: decoder layers of the draft (the fused first one, then plain Llama layers); EAGLE-3's is 1")})
    down_sample_ratio: float = field(default=0.7, metadata={"help": (
        "P-EAGLE: depth d keeps a share max(ratio^d, down_sample_ratio_min) of the row's supervised positions "
        "(COD sampling)")})
    down_sample_ratio_min: float = field(default=0.2, metadata={"help": "P-EAGLE: the floor of that share"})
    mask_token_id: int | None = field(default=None, metadata={"help": (
        "P-EAGLE (required there): the token at every masked slot, a reserved one the data never uses (saved in "
        "config.json: the serving engine fills the slots with it)")})
    sequence_partitions: int = field(default=1, metadata={"help": (
        "P-EAGLE: upstream's memory knob running each row's segments as separate backward passes (the same loss "
        "and gradients): 1 only")})

    def __post_init__(self) -> None:
        errors = {}
        if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            errors["ttt_steps"] = f"expected a whole number >= 1, found {self.ttt_steps!r}"
        size = self.draft_vocab_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            errors["draft_vocab_size"] = f"expected a whole number >= 1, found {size!r}"
        ids = self.aux_layer_ids
        if ids is not None and (not isinstance(ids, list) or len(ids) != 3 or len(set(ids)) != 3 or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            errors["aux_layer_ids"] = f"expected three different layer indices >= 0, found {ids!r}"
        if self.draft_attn_implementation == "flash_attention_2":
            errors["draft_attn_implementation"] = f"flash_attention_2 {GPU_ONLY}; use eager or sdpa (the same numbers)"
        elif self.draft_attn_implementation not in ATTENTION:
            errors["draft_attn_implementation"] = f"expected eager or sdpa, found {self.draft_attn_implementation!r}"
        if self.target_force_hf is not True:
            errors["target_force_hf"] = (f"{self.target_force_hf!r}: upstream's own target model classes are not "
                                         "built here; the target is transformers' class (true)")
        errors.update(self.parallel_errors())
        if self.cp_zigzag is not False:
            errors["cp_zigzag"] = (f"{self.cp_zigzag!r}: a layout of the draft's context parallelism, which this "
                                   "recipe does not run (the draft reads whole sequences); use false")
        if errors:
            raise FieldErrors(errors)

    def parallel_errors(self) -> dict[str, str]:
        """What is wrong with P-EAGLE's keys (each acts with ``parallel_drafting: true`` only)."""
        errors: dict[str, str] = {}
        if not isinstance(self.parallel_drafting, bool):
            return {"parallel_drafting": f"expected true or false, found {self.parallel_drafting!r}"}
        if self.freeze_embeddings not in (None, True, False):
            errors["freeze_embeddings"] = f"expected true, false or null, found {self.freeze_embeddings!r}"
        if not self.parallel_drafting:
            for name, default in PARALLEL_DEFAULTS.items():
                if getattr(self, name) != default:
                    errors[name] = (f"{getattr(self, name)!r}: a key of P-EAGLE's parallel drafting; set "
                                    "parallel_drafting: true, or remove it")
            return errors
        for name, least in (("num_depths", 1), ("num_draft_layers", 1), ("mask_token_id", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                errors[name] = f"expected a whole number >= {least}, found {value!r}"
        if self.mask_token_id is None:
            errors["mask_token_id"] = ("required with parallel_drafting: the id of a reserved token the data never "
                                       "uses (e.g. 128002 for Llama 3, 151669 for Qwen3), which fills the masked "
                                       "slots here and at serving")
        for name in ("down_sample_ratio", "down_sample_ratio_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                errors[name] = f"expected a number in (0, 1], found {value!r}"
        if self.sequence_partitions != 1:
            errors["sequence_partitions"] = (f"{self.sequence_partitions!r}: the segments' separate backward passes "
                                             "(a memory knob giving the same loss and gradients) are not built: the "
                                             "loop here runs one backward per micro-batch; use 1")
        if self.ttt_steps != 7:
            errors["ttt_steps"] = (f"{self.ttt_steps!r}: EAGLE-3's unroll, which P-EAGLE replaces (it drafts "
                                   "num_depths tokens in one forward); remove it")
        return errors

    @property
    def frozen_embeddings(self) -> bool:
        """Whether the draft's embeddings stay frozen (unset: EAGLE-3's frozen, P-EAGLE's trained)."""
        return (not self.parallel_drafting) if self.freeze_embeddings is None else self.freeze_embeddings


# P-EAGLE's keys and their defaults (each refused away from it without parallel_drafting)
PARALLEL_DEFAULTS = {"num_depths": 8, "num_draft_layers": 1, "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2,
                     "mask_token_id": None, "sequence_partitions": 1}


def default_aux_layers(layers: int) -> list[int]:
    """Upstream's low, middle and high layers of a target of ``layers`` layers (the outputs of these)."""
    return [1, layers // 2 - 1, layers - 4]


def aux_layer_issue(ids: list[int] | None, layers: int) -> str | None:
    """What is wrong with the target layers ``ids`` (None: upstream's default) for a target of ``layers`` layers;
    None when nothing is."""
    chosen = ids if ids is not None else default_aux_layers(layers)
    if all(0 <= i < layers for i in chosen) and len(set(chosen)) == 3:
        return None
    if ids is not None:
        return f"{ids}: the target has {layers} layers (0..{layers - 1}): name three different ones"
    return (f"unset, and the default {chosen} does not fit a target of {layers} layers: name three different layers "
            f"(0..{layers - 1})")


# upstream's TrainEagle3Recipe recipe_args: each key -> the key it stands for here, or why it is refused
RECIPE_ARGS = draft_recipe_args(
    "TrainEagle3Recipe", "eagle3",
    ("ttt_steps", "draft_vocab_size", "aux_layer_ids", "freeze_embeddings", "selected_token_ids_path",
     "draft_attn_implementation", "fc_norm", "norm_output", "draft_weights_path", "target_force_hf", "cp_zigzag",
     "parallel_drafting", *PARALLEL_DEFAULTS),
    {**dict.fromkeys(("lk_loss_type", "lk_kl_scale", "lk_kl_decay"),
                     NOT_BUILT.format(what="the acceptance-rate (LK) loss"))},
    # the draft's layer recomputed in the backward pass at each unrolled step
    keys={"draft_gradient_checkpointing": "distributed.activation_checkpointing"})
