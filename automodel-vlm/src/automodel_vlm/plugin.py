"""The VLM domain's registrations (what a third-party plugin would write). Import-light: no torch."""

from automodel import hookimpl

_RECIPE = "automodel_vlm.recipe.FinetuneRecipeForVLM"


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "vlm", recipe=_RECIPE, help="Fine-tune a vision-language (image-text-to-text) model",
               examples=["vlm/tiny_llava"])


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.domain("vision-language", "vlm")
    aliases.recipe("FinetuneRecipeForVLM", "finetune", "vlm")  # upstream's recipe class, by name and by path
    aliases.recipe("nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM", "finetune", "vlm")
    aliases.target("AutoModelForImageTextToText", "automodel_vlm.AutoModelForImageTextToText.from_pretrained")
    aliases.target("ImageTextChatDataset", "automodel_vlm.datasets.ImageTextChatDataset")
    # Upstream (NeMo AutoModel) public paths, so its users' configs run unchanged.
    aliases.target("nemo_automodel.NeMoAutoModelForImageTextToText.from_pretrained",
                   "automodel_vlm.AutoModelForImageTextToText.from_pretrained")
    aliases.target("nemo_automodel.NeMoAutoModelForImageTextToText.from_config",
                   "automodel_vlm.AutoModelForImageTextToText.from_config")


@hookimpl
def automodel_register_stages(stages) -> None:
    stages.add("peft", "vlm_lora", "automodel_vlm.peft.apply_lora_to_language_model")
    stages.add("freeze", "vlm", "automodel_vlm.freeze.freeze_vlm")


@hookimpl
def automodel_allowed_targets() -> list[str]:
    return [
        "automodel_vlm",  # its own package
        "transformers.AutoProcessor",  # processor: AutoProcessor.from_pretrained (upstream configs)
        "peft.LoraConfig",  # peft: used as given
    ]
