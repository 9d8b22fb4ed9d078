"""The diffusion domain's registrations (what a third-party plugin would write). Import-light: no torch."""

from automodel import hookimpl

_RECIPE = "automodel_diffusion.recipe.DiffusionRecipe"


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "diffusion", recipe=_RECIPE,
               help="Fine-tune a diffusers text-to-image pipeline's denoiser (flow matching, epsilon, v-prediction)",
               examples=["diffusion/tiny_flow", "diffusion/tiny_unet"])
    routes.add("pretrain", "diffusion", recipe=_RECIPE,
               help="Pre-train a text-to-image denoiser from a pipeline config (same recipe, config differs)",
               examples=["diffusion/tiny_flow"])


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.domain("t2i", "diffusion")
    # Upstream's diffusion recipe (its examples run it from a script, without `recipe:`), by name and by path.
    aliases.recipe("TrainDiffusionRecipe", "finetune", "diffusion")
    aliases.recipe("nemo_automodel.recipes.diffusion.train.TrainDiffusionRecipe", "finetune", "diffusion")
    aliases.target("AutoDiffusionPipeline", "automodel_diffusion.AutoDiffusionPipeline.from_pretrained")
    aliases.target("ImageCaptionDataset", "automodel_diffusion.datasets.ImageCaptionDataset")


@hookimpl
def automodel_register_stages(stages) -> None:
    stages.add("sharding", "diffusion", "automodel_diffusion.parallel.shard_components")


@hookimpl
def automodel_allowed_targets() -> list[str]:
    return ["automodel_diffusion"]
