"""The settings of EAGLE-1 / EAGLE-2 draft training: the ``eagle:`` section, and upstream's ``recipe_args:`` keys of
its ``TrainEagle1Recipe`` / ``TrainEagle2Recipe``. Import-light: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from automodel.config import FieldErrors
from automodel_llm.draft_args import draft_recipe_args


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class EagleConfig:
    draft_num_hidden_layers: int = field(default=1, metadata={"help": (
        "decoder layers of the draft (EAGLE's is one)")})
    hidden_loss_weight: float = field(default=1.0, metadata={"help": (
        "weight of the feature regression: the smooth L1 distance of the predicted feature (the target's last "
        "hidden state one position on), averaged over the hidden size")})
    token_loss_weight: float = field(default=0.1, metadata={"help": (
        "weight of the token loss: the cross entropy of the target's next-token distribution under the target's "
        "output head applied to the predicted feature")})
    feature_noise: float = field(default=0.1, metadata={"help": (
        "half-width of the uniform noise added to the target's features the draft reads while training (EAGLE's "
        "U(-0.1, 0.1)); 0 turns it off. The regression target stays clean; validation reads clean features")})
    freeze_embeddings: bool = field(default=True, metadata={"help": (
        "the draft's token embeddings, copied from the target, stay frozen (false: trained)")})
    target_force_hf: bool = field(default=True, metadata={"help": (
        "upstream's choice of transformers' class for the target over its own: true only (the target here is "
        "transformers' class)")})

    def __post_init__(self) -> None:
        errors = {}
        layers = self.draft_num_hidden_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            errors["draft_num_hidden_layers"] = f"expected a whole number >= 1, found {layers!r}"
        for name in ("hidden_loss_weight", "token_loss_weight", "feature_noise"):
            value = getattr(self, name)
            if not _number(value) or value < 0:
                errors[name] = f"expected a number >= 0, found {value!r}"
        if not errors and self.hidden_loss_weight == 0 and self.token_loss_weight == 0:
            errors["token_loss_weight"] = "hidden_loss_weight and token_loss_weight are both 0: nothing would train"
        if self.target_force_hf is not True:
            errors["target_force_hf"] = (f"{self.target_force_hf!r}: upstream's own target model classes are not "
                                         "built here; the target is transformers' class (true)")
        if errors:
            raise FieldErrors(errors)


# upstream's TrainEagle1Recipe / TrainEagle2Recipe recipe_args: each key -> the key it stands for here, or why refused
RECIPE_ARGS = draft_recipe_args(
    "TrainEagle1Recipe / TrainEagle2Recipe", "eagle",
    ("draft_num_hidden_layers", "hidden_loss_weight", "token_loss_weight", "feature_noise", "freeze_embeddings",
     "target_force_hf"), {})
