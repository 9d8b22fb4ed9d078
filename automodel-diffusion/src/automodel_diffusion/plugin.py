"""The diffusion domain's registrations (what a third-party plugin would write). Import-light: no torch."""

from automodel import hookimpl

_RECIPE = "automodel_diffusion.recipe.DiffusionRecipe"
_UPSTREAM_DATA = "nemo_automodel.components.datasets.diffusion"


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "diffusion", recipe=_RECIPE,
               help="Fine-tune a diffusers text-to-image / text-to-video pipeline's denoiser (flow matching, epsilon, "
                    "v-prediction)",
               examples=["diffusion/tiny_flow", "diffusion/tiny_unet"])
    routes.add("pretrain", "diffusion", recipe=_RECIPE,
               help="Pre-train a text-to-image denoiser from a pipeline config (same recipe, config differs)",
               examples=["diffusion/tiny_flow"])
    routes.add("precompute", "diffusion", recipe="automodel_diffusion.precompute.PrecomputeRecipe",
               help="Encode images and captions once with a pipeline's VAE and text encoders into a latent cache "
                    "(safetensors), on which the transformer trains alone (model.pipeline_spec.load_full_pipeline: "
                    "false)", examples=["diffusion/tiny_precompute"])
    routes.add("generate", "diffusion", recipe="automodel_diffusion.generate.GenerateRecipe",
               help="Generate images from prompts with a diffusers pipeline or a trained checkpoint (upstream's "
                    "generation config: model, inference, output, vae)", examples=["diffusion/tiny_generate"])


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.domain("t2i", "diffusion")
    # Upstream's diffusion recipe (its examples run it from a script, without `recipe:`), by name and by path.
    aliases.recipe("TrainDiffusionRecipe", "finetune", "diffusion")
    aliases.recipe("nemo_automodel.recipes.diffusion.train.TrainDiffusionRecipe", "finetune", "diffusion")
    aliases.target("AutoDiffusionPipeline", "automodel_diffusion.AutoDiffusionPipeline.from_pretrained")
    aliases.target("ImageCaptionDataset", "automodel_diffusion.datasets.ImageCaptionDataset")
    aliases.target("VideoCaptionDataset", "automodel_diffusion.datasets.VideoCaptionDataset")
    aliases.target("LatentCacheDataset", "automodel_diffusion.latents.LatentCacheDataset")
    aliases.target("ImageEditDataset", "automodel_diffusion.edit.ImageEditDataset")
    # Upstream (NeMo AutoModel) names: its data loader builders.
    aliases.target(f"{_UPSTREAM_DATA}.build_text_to_image_multiresolution_dataloader",
                   "automodel_diffusion.upstream.text_to_image_data")
    aliases.target(f"{_UPSTREAM_DATA}.build_video_multiresolution_dataloader",
                   "automodel_diffusion.upstream.text_to_video_data")
    aliases.target(f"{_UPSTREAM_DATA}.image_edit_dataset.ImageEditDataloaderConfig",
                   "automodel_diffusion.upstream.image_edit_data")


@hookimpl
def automodel_register_stages(stages) -> None:
    stages.add("sharding", "diffusion", "automodel_diffusion.parallel.shard_components")
    stages.add("peft", "diffusion_lora", "automodel_diffusion.lora.add_denoiser_lora")


@hookimpl
def automodel_allowed_targets() -> list[str]:
    return ["automodel_diffusion", "peft.LoraConfig"]  # peft: used as given
