"""A latent cache: what a pipeline's VAE and text encoders make of a data set, in safetensors shards.

``automodel precompute diffusion`` writes it (``automodel_diffusion.precompute``); training with
``model.pipeline_spec.load_full_pipeline: false`` reads it, so that only the transformer is loaded. A cache folder
holds ``manifest.json`` (written last: a folder without it is incomplete), ``shard_<nnnnn>.safetensors`` files and
``empty_caption.safetensors``. Per sample a shard holds

* ``<i>.latent_parameters``: the VAE's latent distribution (its mean and log-variance, diffusers'
  ``DiagonalGaussianDistribution.parameters``), so that training draws each step's latent from it exactly as
  encoding on the fly does;
* ``<i>.cond.<name>``: the family conditioning's ``encode`` output for the caption (one caption at a time);

and its metadata the shard's captions (JSON). ``empty_caption.safetensors`` is the encoding of the empty caption,
which the objective's caption dropout trains on. Safetensors files are data only: nothing in a cache is unpickled.
Import-light: no torch at import (upstream.py checks caches at validation).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel.errors import AutomodelError

if TYPE_CHECKING:
    import torch

FORMAT = "automodel-diffusion-latents"
VERSION = 1
MANIFEST = "manifest.json"
EMPTY = "empty_caption.safetensors"
PICKLES = ("*.pt", "*.pth", "**/*.pt", "**/*.pth")
HOW_TO_MAKE = ("make one with `automodel precompute diffusion -c <config> --output.cache_dir <dir>` (docs: the "
               "diffusion README, 'Training on a latent cache')")


def is_latent_cache(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def is_pickle_cache(folder: str | Path) -> bool:
    """Upstream's cache of precomputed latents: ``torch.save`` files, which are never loaded here."""
    return any(next(Path(folder).glob(pattern), None) is not None for pattern in PICKLES)


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The cache's manifest; a folder that is not a cache of this format is an error saying how to make one."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        kind = ("upstream's cache of precomputed latents (torch.save pickles, never loaded here)"
                if Path(folder).is_dir() and is_pickle_cache(folder) else "not a latent cache (no manifest.json)")
        raise AutomodelError(f"data.dataloader.cache_dir: '{folder}' is {kind}; {HOW_TO_MAKE}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise AutomodelError(f"data.dataloader.cache_dir: '{path}' is unreadable ({err}); {HOW_TO_MAKE}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise AutomodelError(f"data.dataloader.cache_dir: '{path}' is not a {FORMAT} manifest of version {VERSION}; "
                             f"{HOW_TO_MAKE}")
    return manifest


# ---- writing ----------------------------------------------------------------------------------------------------


def _write_atomic(path: Path, write: Any) -> None:
    """``write(staging path)`` then renamed onto ``path``: a reader never sees a partial file."""
    staging = path.with_name(f".incomplete-{os.getpid()}-{path.name}")
    write(staging)
    os.replace(staging, path)


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    _write_atomic(path, lambda staging: save_file(cpu, str(staging), metadata=metadata))


class CacheWriter:
    """Writes samples into ``folder`` in shards of ``shard_size``; ``finish`` writes the manifest last."""

    def __init__(self, folder: Path, shard_size: int, empty_conditions: dict[str, torch.Tensor]):
        self.folder, self.shard_size = folder, shard_size
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)  # the folder is incomplete until finish()
        _save({f"cond.{k}": v for k, v in empty_conditions.items()}, folder / EMPTY)
        self.shards: list[dict[str, Any]] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.captions: list[str] = []
        self.first: dict[str, torch.Tensor] | None = None

    def add(self, latent_parameters: torch.Tensor, conditions: dict[str, torch.Tensor], caption: str) -> None:
        index = len(self.captions)
        sample = {"latent_parameters": latent_parameters, **{f"cond.{k}": v for k, v in conditions.items()}}
        self.first = self.first or sample
        self.pending.update({f"{index}.{k}": v for k, v in sample.items()})
        self.captions.append(caption)
        if len(self.captions) == self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.captions:
            return
        name = f"shard_{len(self.shards):05d}.safetensors"
        _save(self.pending, self.folder / name, {"captions": json.dumps(self.captions)})
        self.shards.append({"file": name, "count": len(self.captions)})
        self.pending, self.captions = {}, []

    def finish(self, description: dict[str, Any]) -> dict[str, Any]:
        """The manifest: ``description`` (family, source, settings) with the shards, counts, shapes and dtypes."""
        self.flush()
        if self.first is None:
            raise AutomodelError("dataset: no samples to precompute")
        manifest = {"format": FORMAT, "version": VERSION, **description,
                    "count": sum(s["count"] for s in self.shards), "shards": self.shards,
                    "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                                for k, v in self.first.items()}}
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        _write_atomic(self.folder / MANIFEST, lambda staging: staging.write_text(text, encoding="utf-8"))
        for stale in sorted(self.folder.glob("shard_*.safetensors"))[len(self.shards):]:
            stale.unlink()  # a previous, larger cache's shards
        return manifest


# ---- reading ----------------------------------------------------------------------------------------------------


def _open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise AutomodelError(f"data.dataloader.cache_dir: the cache file '{path}' is missing or corrupted ({err}); "
                             f"{HOW_TO_MAKE}") from None


class LatentCacheDataset:
    """The samples of a latent cache, ``{"latent_parameters", "conditions", "caption"}`` (and the empty caption's
    conditions, which ``collate_latents`` hands to the model for caption dropout): a map-style data set (torch's
    ``Dataset`` protocol, without importing torch)."""

    def __init__(self, path: str):
        self.folder = Path(path)
        self.manifest = read_manifest(self.folder)
        self.locations: list[tuple[int, int]] = []  # sample -> (shard, index in the shard)
        self.captions: list[str] = []
        self.shards = []
        for number, shard in enumerate(self.manifest["shards"]):
            handle = _open(self.folder / shard["file"])
            captions = json.loads((handle.metadata() or {}).get("captions", "null") or "null")
            if not isinstance(captions, list) or len(captions) != shard["count"]:
                raise AutomodelError(f"data.dataloader.cache_dir: the cache file '{self.folder / shard['file']}' "
                                     f"does not hold the {shard['count']} samples the manifest lists; {HOW_TO_MAKE}")
            self.locations += [(number, i) for i in range(shard["count"])]
            self.captions += captions
            self.shards.append(handle)
        empty = _open(self.folder / EMPTY)
        self.empty_conditions = {k.removeprefix("cond."): empty.get_tensor(k) for k in empty.keys()}
        self.resolution = self.manifest.get("resolution")
        self.num_frames = self.manifest.get("num_frames")

    def __len__(self) -> int:
        return len(self.locations)

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, position = self.locations[int(index)]
        try:
            tensors = {name: self.shards[shard].get_tensor(f"{position}.{name}") for name in self.manifest["tensors"]}
        except Exception as err:  # noqa: BLE001 - a damaged file fails only when its tensor is read
            raise AutomodelError(f"data.dataloader.cache_dir: the cache file "
                                 f"'{self.folder / self.manifest['shards'][shard]['file']}' is corrupted or lacks "
                                 f"sample {position} ({err}); {HOW_TO_MAKE}") from None
        return {"latent_parameters": tensors.pop("latent_parameters"), "caption": self.captions[int(index)],
                "conditions": {k.removeprefix("cond."): v for k, v in tensors.items()},
                "empty_conditions": self.empty_conditions}

    def __getstate__(self) -> dict[str, Any]:  # data loader workers reopen the files
        return {"path": str(self.folder)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])


def collate_latents(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch for ``AutoDiffusionPipeline.forward(None, captions, cached=...)``."""
    import torch

    return {"captions": [s["caption"] for s in samples],
            "cached": {"latent_parameters": torch.stack([s["latent_parameters"] for s in samples]),
                       "conditions": [s["conditions"] for s in samples],
                       "empty_conditions": samples[0]["empty_conditions"]}}


def fit_issue(manifest: dict[str, Any], model: Any) -> str | None:
    """Why a cache does not fit the model being trained (None: it fits): another pipeline family, another VAE, or
    captions encoded with another max_sequence_length."""
    family = type(model.pipeline).__name__
    if manifest.get("pipeline_class") != family:
        return (f"it was made with a {manifest.get('pipeline_class')}, but the model is a {family}; make the cache "
                f"with this model's pipeline ({HOW_TO_MAKE})")
    ours = json.loads(json.dumps(dict(model.conditioning.vae_config)))
    theirs = manifest.get("vae_config", {})
    differ = sorted(k for k in ours.keys() & theirs.keys() if not k.startswith("_") and ours[k] != theirs[k])
    if differ:
        return (f"it was made with another VAE than this model's (their configs differ in {', '.join(differ)}); "
                f"{HOW_TO_MAKE}")
    theirs, ours = manifest.get("max_sequence_length"), model.max_sequence_length
    if theirs != ours:
        said = {None: "unset (the pipeline's own default)"}
        return (f"its captions were encoded with max_sequence_length {said.get(theirs, theirs)}, this run's is "
                f"{said.get(ours, ours)}: set model.max_sequence_length to {theirs if theirs is not None else 'null'} "
                "to match, or remake the cache")
    return None


# ---- validation: training the transformer alone -----------------------------------------------------------------


def transformer_alone(cfg: Any) -> bool:
    """Whether upstream's ``model.pipeline_spec.load_full_pipeline: false`` loads the transformer alone."""
    model = cfg.model
    spec = model.get("pipeline_spec") if model is not None and model.target is None else None
    return hasattr(spec, "get") and spec.get("load_full_pipeline") is False


def transformer_alone_issues(cfg: Any) -> list[Any]:
    """What cannot act with the transformer loaded alone: anything that needs the VAE or text encoders (image data,
    validation data, samples, trained encoders) and LoRA (not implemented for it)."""
    from automodel.errors import ConfigIssue

    if not transformer_alone(cfg):
        return []
    why = "the transformer is loaded alone (model.pipeline_spec.load_full_pipeline: false)"
    issues = []
    subfolder = cfg.model["pipeline_spec"].get("subfolder", "transformer")
    trained = cfg.model.get("trainable_components")
    if trained is not None and list(trained) != [subfolder]:
        issues.append(ConfigIssue("model.trainable_components", f"{list(trained)}: {why}, so only '{subfolder}' "
                                                                "trains; remove it"))
    if cfg.get("peft") is not None:
        issues.append(ConfigIssue("peft", f"LoRA is not implemented when {why}; remove it, or set "
                                          "load_full_pipeline: true"))
    datasets = {name: cfg.get(name) for name in cfg.section_names() if name in ("dataset", "validation_dataset")
                or name.startswith("validation_dataset_")}
    for name, node in datasets.items():
        if node is not None and str(node.target).rsplit(".", 1)[-1] != "LatentCacheDataset":
            issues.append(ConfigIssue(name, f"{why}: it trains and validates on latent caches "
                                            f"(automodel_diffusion.latents.LatentCacheDataset, or "
                                            f"data.dataloader.cache_dir); {HOW_TO_MAKE}"))
    if "sample_generation" in cfg and cfg.sample_generation is not None and cfg.sample_generation.enabled:
        issues.append(ConfigIssue("sample_generation.enabled", f"samples need the full pipeline, but {why}; set "
                                                               "false (generate diffusion samples from the full "
                                                               "pipeline with the trained transformer)"))
    data = cfg.get("data") if "data" in cfg else None
    loader = data.get("dataloader") if hasattr(data, "get") else None
    cache = loader.get("cache_dir") if hasattr(loader, "get") else None
    if isinstance(cache, str) and not is_latent_cache(cache) and not is_pickle_cache(cache):
        issues.append(ConfigIssue("data.dataloader.cache_dir", f"'{cache}' is not a latent cache (no manifest.json) "
                                                               f"but {why}, which trains on precomputed latents; "
                                                               f"{HOW_TO_MAKE}"))
    return issues
