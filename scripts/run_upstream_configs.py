"""Run upstream's example configs for a few steps on this machine: the ones ``automodel validate`` passes.

A developer tool beside ``check_upstream_configs.py`` (which validates them), reading a local copy of upstream's
``examples/`` directory (nothing upstream is kept here):

    .venv/bin/python scripts/run_upstream_configs.py /path/to/upstream/examples --steps 2 [--cpu] [--only NAME ...]

Each config runs as a user without network would run it: ``automodel run -c FILE`` from upstream's repository root
(a config without ``recipe:``, such as a generation config, through the route validation chose: ``automodel generate
diffusion -c FILE``), every hub model / tokenizer / processor id overridden with a tiny local model of that domain
(fresh weights, the shipped tokenizer or processor; an LLM of a family in ``LLM_FAMILIES`` a tiny model of that
family built from its transformers config class, another LLM a tiny Llama, either with the layers, experts and
heads its ``distributed`` layout needs (``layout_sizes``), a VLM of a family in
``vlm_stand_ins.FAMILIES`` its tiny model and processor, a Gemma 4 assistant (``drafter_path``) one made for the tiny
Gemma 4, a sequence-to-sequence model a tiny T5, a diffusion model the diffusion tests' tiny pipeline of its family),
every data set path with a small local file in the columns its ``_target_`` reads (SQuAD, HellaSwag, chat, tool
calls, xLAM, column-mapped, MedPix, CORD-v2, Shopify; the shipped retrieval rows for a ``data_dir_list``; tiny
clips or the shipped shapes pictures for a diffusion loader, at 64 x 64 where it names a ``base_resolution``
(HunyuanVideo's ``default_image_embed_shape`` the tiny transformer's width);
Megatron indexed files; a nanogpt shard),
``step_scheduler.max_steps`` and a scratch ``checkpoint.checkpoint_dir``. A generation config makes ``--steps``
denoising steps of 64 x 64 pictures (5 frames for a video) into a scratch ``output.output_dir``. A config laid out
for 2 to 4 processes (``--max-processes N``: to N) runs on that many (``--nproc-per-node``, gloo); nothing else
changes, so a config laid out for more (tp_size 8, say) is refused by the run for that, unless ``--one-process``
runs it in one process with each of its parallel sizes above 1 set to 1 (``LAYOUT_KEYS``) and its global batch one
local batch (the rest of the config as written). It prints each file's exit status and, for a failure, the run's
last error lines, then the count.

``--cpu`` also runs the configs refused only for GPU features or for ``trust_remote_code: true``, as a user on a
machine without a GPU would: each refused key gets the CPU alternative its refusal message names
(``CPU_OVERRIDES``: backend torch / sdpa / torch_fp32, no fused RoPE, no FP8 / Liger / THD collater /
Transformer Engine loss, torch's AdamW, fsdp2, ...) in a scratch copy of the config, validated again
until it passes, and the run gets ``--trust-remote-code``. A file refused for anything else is skipped with the
refusal. ``--validate-only`` counts the files that would run (with ``--cpu``: after those edits) without running
them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import check_upstream_configs as survey  # noqa: E402  (the validation survey: hub keys, domains, validation)

from automodel.testing import free_port, run_cli  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "automodel-diffusion" / "tests"))
import diffusion_testing  # noqa: E402  (the diffusion tests' tiny pipelines of each family, and tiny clips)
import vlm_stand_ins  # noqa: E402  (the VLM tests' tiny models of each family, with their processors)

# upstream data set factory (last name of its _target_) -> the local file written for it
DATA_FILES = {"HellaSwag": "hellaswag.jsonl", "ChatDataset": "chat.jsonl", "make_agent_chat_dataset": "chat.jsonl",
              "make_xlam_dataset": "xlam.jsonl", "make_medpix_dataset": "medpix.jsonl",
              "make_cord_v2_dataset": "cord.jsonl", "make_shopify_product_catalogue_dataset": "shopify.jsonl",
              "ToolCallAccuracyEvaluator": "tool_calls.jsonl", **vlm_stand_ins.DATA_FILES}
PATH_KEYS = ("dataset_name", "path_or_dataset", "path_or_dataset_id", "data_files")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_data(root: Path) -> None:
    """One small file per data set form, the VLM ones with the shipped shapes pictures."""
    from importlib.resources import files

    shapes = Path(str(files("automodel_vlm").joinpath("examples", "assets", "tiny_shapes")))
    images = sorted(str(p) for p in (shapes / "images").glob("train_*.png"))[:32]
    tools = json.dumps([{"name": "add", "description": "add two numbers",
                         "parameters": {"a": {"type": "int"}, "b": {"type": "int"}}}])
    _write_jsonl(root / "hellaswag.jsonl", [{"ctx": f"Person {k} sits on a roof. He", "endings": [
        " is using wrap.", " starts pulling up roofing.", " rips tiles.", " holds a rope."], "label": str(k % 4)}
        for k in range(32)])
    _write_jsonl(root / "chat.jsonl", [{"messages": [{"role": "user", "content": f"What is {k} plus {k}?"},
                                                     {"role": "assistant", "content": f"It is {2 * k}."}]}
                                       for k in range(32)])
    _write_jsonl(root / "tool_calls.jsonl", [{"tools": tools, "conversations": [
        {"from": "human", "value": f"Add {k} and 2"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": k, "b": 2}})},
        {"from": "observation", "value": str(k + 2)}, {"from": "gpt", "value": f"It is {k + 2}."}]}
        for k in range(32)])
    _write_jsonl(root / "xlam.jsonl", [{"id": k, "query": f"Add {k} and 2", "tools": tools, "answers": json.dumps(
        [{"name": "add", "arguments": {"a": k, "b": 2}}])} for k in range(32)])
    _write_jsonl(root / "medpix.jsonl", [{"image_id": image, "question": "What shape is shown?",
                                          "answer": f"shape {k}"} for k, image in enumerate(images)])
    _write_jsonl(root / "cord.jsonl", [{"image": image, "ground_truth": json.dumps(
        {"gt_parse": {"shape": {"kind": f"kind {k}"}}})} for k, image in enumerate(images)])
    _write_jsonl(root / "shopify.jsonl", [{"product_image": image, "ground_truth_category": f"Toys > {k} shapes"}
                                          for k, image in enumerate(images)])
    from transformers import AutoTokenizer

    from automodel_llm.datasets.write_megatron import jsonl_to_indexed

    corpus = _write_jsonl(root / "corpus.jsonl", [{"text": " ".join(f"Person {k} sits on roof {j}." for j in range(40))}
                                                  for k in range(256)])  # a 1% validation split of 2 documents
    jsonl_to_indexed(corpus, root / "megatron_text_document", AutoTokenizer.from_pretrained(
        survey.local_assets()["llm"]["tokenizer"]))
    import numpy as np  # a modded-nanogpt shard: 256 int32 of header (magic, version, count), uint16 tokens

    tokens = np.random.default_rng(0).integers(3, 482, 1 << 16).astype(np.uint16)
    (root / "nanogpt_000.bin").write_bytes(np.array([20240520, 1, tokens.size, *[0] * 253], np.int32).tobytes() +
                                           tokens.tobytes())
    vlm_stand_ins.write_vlm_data(root, root / "medpix.jsonl")
    _write_jsonl(root / "mrpc.jsonl", [{"sentence1": f"Person {k} sits on a roof.", "sentence2": f"Person {k % 5} sits "
                                        "on a roof.", "label": int(k % 5 == k)} for k in range(32)])


def write_models(root: Path) -> dict[str, dict[str, str]]:
    """Per domain, the validation survey's local assets with the LLM and VLM model ids pointing at a saved model
    (fresh weights, safetensors) whose directory also holds the tokenizer / processor, as a hub download does."""
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
    )

    from automodel_vlm.processor import build_processor

    assets = survey.local_assets()
    llm, vlm = root / "llm", root / "vlm"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets["llm"]["model"])).save_pretrained(llm)
    for item in Path(assets["llm"]["tokenizer"]).iterdir():
        shutil.copy(item, llm)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(assets["vlm"]["model"])).save_pretrained(vlm)
    build_processor(assets["vlm"]["processor"], assets["vlm"]["tokenizer"], processor_class="LlavaProcessor",
                    patch_size=8, vision_feature_select_strategy="default",
                    num_additional_image_tokens=1).save_pretrained(str(vlm))
    t5 = root / "t5"
    t5_asset = Path(assets["llm"]["model"]).with_name("tiny_t5")
    AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(t5_asset)).save_pretrained(t5)
    for item in t5_asset.glob("tokenizer*"):
        shutil.copy(item, t5)
    for domain, directory in (("llm", llm), ("vlm", vlm)):
        assets[domain] = {kind: str(directory) for kind in ("model", "tokenizer", "processor")} | {
            "dataset": assets[domain]["dataset"]}
    assets["seq2seq"] = {**assets["llm"], "model": str(t5), "tokenizer": str(t5)}
    seq_cls = root / "seq_cls"  # a base encoder without a classifier (upstream's roberta-large), and the tokenizer
    AutoModel.from_config(AutoConfig.from_pretrained(Path(survey.local_assets()["llm"]["model"]).with_name("tiny_bert"))
                          ).save_pretrained(seq_cls)
    for item in Path(survey.local_assets()["llm"]["tokenizer"]).iterdir():
        shutil.copy(item, seq_cls)
    assets["seq_cls"] = {**assets["llm"], "model": str(seq_cls), "tokenizer": str(seq_cls)}
    for name, config_class in FAMILIES.items():
        directory = root / f"llm-{config_class}"
        if not directory.exists():  # families sharing a config class share the model
            write_tiny_llm(config_class, directory, Path(survey.local_assets()["llm"]["tokenizer"]))
        assets[f"llm:{name}"] = {**assets["llm"], **{kind: str(directory) for kind in ("model", "tokenizer",
                                                                                        "processor")}}
    for name, build in DIFFUSION_FAMILIES.items():
        assets[f"diffusion:{name}"] = {**assets["diffusion"], "model": str(getattr(diffusion_testing, build)(
            root / name))}
    diffusion_testing.tiny_clips(root / "clips")
    assets["vlm:families"] = vlm_stand_ins.write_family_models(root / "vlm_families")
    return assets


# a part of an upstream diffusion hub id (the first that matches) -> the diffusion tests' tiny pipeline of its family
DIFFUSION_FAMILIES = {"Wan2.2": "tiny_wan22", "Wan": "tiny_wan", "LTX-2": "tiny_ltx2",
                      "HunyuanVideo-1.5": "tiny_hunyuan", "FLUX.2": "tiny_flux2", "FLUX.1": "tiny_flux",
                      "Qwen-Image-Edit": "tiny_qwen_image_edit", "Qwen-Image": "tiny_qwen_image"}
VIDEO_FAMILIES = ("Wan2.2", "Wan", "LTX-2", "HunyuanVideo-1.5")


# a part of an upstream LLM hub id (a regular expression; the first that matches) -> the transformers config class
# of its family; an id that matches none gets the tiny Llama
LLM_FAMILIES = {
    r"Qwen3-Next": "Qwen3NextConfig", r"Qwen3\.5": "Qwen3_5MoeTextConfig", r"Qwen3-\d+B-A\d+B": "Qwen3MoeConfig",
    # mixtures of experts whose code transformers lacks (remote code): a transformers MoE of the same kind
    r"Kimi-Linear": "KimiLinearConfig",
    r"Ling-": "Qwen3MoeConfig", r"Qwen3\.8-.*-A\d+B": "Qwen3MoeConfig", r"Step-3\.5": "Qwen3MoeConfig",
    r"Qwen3-": "Qwen3Config", r"Qwen1\.5-MoE": "Qwen2MoeConfig", r"Qwen2|QwQ": "Qwen2Config",
    r"gemma-2-": "Gemma2Config", r"gemma-3|functiongemma": "Gemma3TextConfig", r"gemma-7b": "GemmaConfig",
    r"Mixtral": "MixtralConfig", r"Mistral-Small-4": "Mistral4Config",
    r"Mistral-|Devstral|Ministral": "MistralConfig", r"phi-4|Phi-3": "Phi3Config",
    r"phi-2": "PhiConfig", r"DeepSeek-V3$|Moonlight|Kimi-K[23]": "DeepseekV3Config", r"DeepSeek-V4": "DeepseekV4Config",
    r"DeepSeek-V3\.2": "DeepseekV32Config",
    r"gpt-oss": "GptOssConfig", r"granite-3": "GraniteConfig", r"Nemotron-3[-.]|Nemotron-Nano-9B": "NemotronHConfig",
    r"OLMo-2": "Olmo2Config", r"GLM-5": "GlmMoeDsaConfig", r"GLM-4\.7-Flash": "Glm4MoeLiteConfig",
    r"GLM-4\.[57]": "Glm4MoeConfig", r"glm-4-9b": "GlmConfig", r"Falcon-H1": "FalconH1Config",
    r"starcoder2": "Starcoder2Config",
    r"command-r7b": "Cohere2Config", r"ERNIE-4\.5-21B": "Ernie4_5_MoeConfig", r"ERNIE-4\.5": "Ernie4_5Config",
    r"MiniMax-M2": "MiniMaxM2Config", r"Seed-OSS": "SeedOssConfig", r"Hy3|Hy-MT2": "HYV3Config",
    r"Laguna": "LagunaConfig", r"MiMo-V2": "MiMoV2FlashConfig", r"community/gpt2": "GPT2Config",
    r"Llama": "LlamaConfig",  # untied, unlike the shipped tiny Llama, as the bigger Llamas (pipeline stages)
}
# DSpark targets whose draft upstream builds of the target's own kind (Gemma 4's): a tiny one of that family, so
# the draft made is that family's, not the Qwen3-style one a tiny Llama (other Gemma 4 configs' stand-in) gets
DSPARK_FAMILIES = {r"gemma-4": "Gemma4TextConfig"}
FAMILIES = {**DSPARK_FAMILIES, **LLM_FAMILIES}
# tiny sizes, each passed to a family's config class only where that class has the key: 4 layers (a hybrid's one
# full-attention layer in four; pp_size 4), hidden 64, 8 experts (2 per token; an expert-parallel layout of up to
# 8 divides them), room for the shipped tokenizer and upstream's MockIterableDataset (ids below 1024), its
# special tokens
TINY_LLM = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 8,
            "num_local_experts": 8, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_positions": 1024, "n_embd": 64,
            "n_layer": 2, "n_head": 4, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
            "n_groups": 1, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
            "mamba_d_ssm": 64, "sliding_window": 64, "num_nextn_predict_layers": 0, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


# a family's keys beyond TINY_LLM: Nemotron-H declares one MTP depth (attention then MoE), as NVIDIA's Nemotron 3
# checkpoints do, for upstream's configs that train the heads the checkpoint declares; a multi-head latent attention
# (DeepSeek-V3, GLM-4.7-Flash, GLM-5) has as many key/value heads as query heads; GLM-5's sparse-attention indexer
# gets a tiny width and picks 16 keys
FAMILY_EXTRAS = {"NemotronHConfig": {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"]},
                 "DeepseekV3Config": {"num_key_value_heads": 4}, "Glm4MoeLiteConfig": {"num_key_value_heads": 4},
                 "GlmMoeDsaConfig": {"num_key_value_heads": 4, "index_n_heads": 2, "index_head_dim": 16,
                                     "index_topk": 16},
                 "DeepseekV32Config": {"num_key_value_heads": 4, "index_n_heads": 2, "index_head_dim": 16,
                                       "index_topk": 16, "head_dim": 8},
                 # Gemma 4's 12B / 31B: no per-layer inputs (those are the E2B / E4B models'), a soft cap
                 "Gemma4TextConfig": {"hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
                                      "global_head_dim": 32}}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def layout_sizes(data: dict[str, Any], layers: int) -> dict[str, int]:
    """TINY_LLM's sizes that a config's layout needs changed: ``layers`` decoder layers (0: TINY_LLM's 4), as many
    experts as ``distributed.ep_size`` where it is above TINY_LLM's 8 (upstream's 16 to 64), and attention and
    key/value heads that ``tp_size`` divides (the hidden size stays 64)."""
    distributed = data.get("distributed") if isinstance(data.get("distributed"), dict) else {}
    sizes: dict[str, int] = {"num_hidden_layers": layers} if layers > TINY_LLM["num_hidden_layers"] else {}
    ep_size, tp_size = distributed.get("ep_size"), distributed.get("tp_size")
    if isinstance(ep_size, int) and ep_size > TINY_LLM["num_experts"]:
        sizes |= dict.fromkeys(_EXPERT_COUNTS, ep_size)
    if isinstance(tp_size, int) and tp_size > TINY_LLM["num_key_value_heads"]:
        sizes |= {"num_attention_heads": max(tp_size, TINY_LLM["num_attention_heads"]), "num_key_value_heads": tp_size}
    return sizes


def pipeline_layers(data: dict[str, Any]) -> int:
    """The decoder layers a config's pipeline layout needs (``pp_size`` ranks x its stages per rank x
    ``layers_per_stage``, one where it is not given), 0 without one: a stand-in of TINY_LLM's 4 layers cannot take
    upstream's pp_size 8 or its interleaved layouts of 2 to 14 layers per stage."""
    distributed = data.get("distributed") if isinstance(data.get("distributed"), dict) else {}
    pipeline = distributed.get("pipeline") if isinstance(distributed.get("pipeline"), dict) else {}
    pp_size, per_stage = distributed.get("pp_size") or 1, pipeline.get("layers_per_stage") or 1
    if not isinstance(pp_size, int) or pp_size < 2 or not isinstance(per_stage, int):
        return 0
    interleaved = str(pipeline.get("pp_schedule", "1f1b")).lower().replace("_", "") in ("interleaved1f1b", "loopedbfs")
    return pp_size * (2 if interleaved else 1) * per_stage


def draft_target_layers(data: dict[str, Any]) -> int:
    """The decoder layers a draft recipe's named target layers need (``recipe_args.target_layer_ids`` /
    ``aux_layer_ids``: the deepest one + 1), 0 where it names none: upstream's Qwen3.8-27B DFlash 2 reads layer 61."""
    args = data.get("recipe_args") if isinstance(data.get("recipe_args"), dict) else {}
    named = [i for key in ("target_layer_ids", "aux_layer_ids") if isinstance(args.get(key), list)
             for i in args[key] if isinstance(i, int)]
    return max(named) + 1 if named else 0


def eagle_target(data: dict[str, Any]) -> str | None:
    """The target of upstream's EAGLE draft recipes (``recipe_args.target_model_name_or_path``), None elsewhere."""
    args = data.get("recipe_args")
    return args.get("target_model_name_or_path") if isinstance(args, dict) else None


def llm_family(data: dict[str, Any]) -> str | None:
    """The family (a key of FAMILIES) of the first hub id in an LLM config's model section (an EAGLE config's
    target); a DSpark target of a family whose draft is of its own kind upstream: that family (DSPARK_FAMILIES)."""
    ids = re.findall(r"[\w.-]+/[\w.-]+", json.dumps(data.get("model") or eagle_target(data) or {}))
    families = FAMILIES if data.get("recipe") == "TrainDSparkRecipe" else LLM_FAMILIES
    return next((name for hub in ids for name in families if re.search(name, hub)), None)


def write_tiny_llm(config_class: str, directory: Path, tokenizer: Path, sizes: dict[str, int] | None = None) -> None:
    """A fresh tiny model of one family (safetensors) with the shipped tokenizer beside it; ``sizes``: those of
    TINY_LLM changed (``layout_sizes``), over the family's extras."""
    import transformers

    cls = getattr(transformers, config_class)
    known = cls().to_dict()
    extras = FAMILY_EXTRAS.get(config_class, {})
    heads = (sizes or {}).get("num_attention_heads")
    if heads and "num_key_value_heads" in extras:  # a latent attention's key/value heads are its query heads
        extras = {**extras, "num_key_value_heads": heads}
    layers = (sizes or {}).get("num_hidden_layers")
    if layers and isinstance(known.get("layers_block_type"), list):  # Nemotron-H counts its layers' pattern
        pattern = known["layers_block_type"]
        extras = {**extras, "layers_block_type": [pattern[index % len(pattern)] for index in range(layers)]}
    config = cls(**{**{key: value for key, value in TINY_LLM.items() if key in known}, **extras,
                    **{key: value for key, value in (sizes or {}).items() if key in known}})
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto = transformers.AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else \
        transformers.AutoModelForImageTextToText  # transformers maps Mistral Small 4's causal LM there only
    auto.from_config(config).save_pretrained(directory)
    for item in tokenizer.iterdir():
        shutil.copy(item, directory)


def diffusion_family(data: dict[str, Any]) -> str | None:
    """The family (a key of DIFFUSION_FAMILIES) of a diffusion config's hub model id."""
    model = str((data.get("model") or {}).get("pretrained_model_name_or_path", ""))
    return next((name for name in DIFFUSION_FAMILIES if name in model), None)


def transformer_alone(data: dict[str, Any]) -> bool:
    """Whether a diffusion config trains its transformer alone on a latent cache (upstream's pretrain form:
    ``model.pipeline_spec.load_full_pipeline: false`` with the data loader's ``cache_dir``)."""
    spec = (data.get("model") or {}).get("pipeline_spec") if isinstance(data.get("model"), dict) else None
    loader = (data.get("data") or {}).get("dataloader") if isinstance(data.get("data"), dict) else None
    return isinstance(spec, dict) and spec.get("load_full_pipeline") is False and isinstance(loader, dict) \
        and "cache_dir" in loader


def latent_cache(pipeline: Path, family: str) -> Path:
    """A latent cache of the tiny pictures (a video family: the tiny clips) that ``automodel precompute diffusion``
    writes once with the family's tiny pipeline, beside it."""
    cache = pipeline.with_name(f"{pipeline.name}-latents")
    if (cache / "manifest.json").is_file():
        return cache
    video = family in VIDEO_FAMILIES
    dataset = ["--dataset._target_", "automodel_diffusion.datasets.VideoCaptionDataset", "--dataset.path",
               str(pipeline.parent / "clips"), "--dataset.num_frames", "5"] if video else \
        ["--dataset.path", str(Path(survey.local_assets()["diffusion"]["dataset"]) / "train.jsonl")]
    result = run_cli("precompute", "diffusion", "-c", "diffusion/tiny_precompute",
                     "--model.pretrained_model_name_or_path", str(pipeline), *dataset, "--dataset.resolution", "64",
                     "--output.cache_dir", str(cache), "--model.max_sequence_length", "null", cwd=pipeline.parent,
                     timeout=600, OMP_NUM_THREADS="1")
    if result.returncode != 0:
        raise SystemExit(f"the latent cache of {family}'s tiny pipeline: {result.stderr[-2000:]}")
    return cache


def stand_ins(data: dict[str, Any], assets: dict[str, dict[str, str]], domain: str) -> dict[str, str]:
    """The hub-id overrides of the validation survey; a sequence-to-sequence model (and its tokenizer) gets the
    tiny T5 stand-in instead of the domain's decoder, an LLM of a family in LLM_FAMILIES a tiny one of that
    family."""
    model = str((data.get("model") or {}).get("_target_", "")) if isinstance(data.get("model"), dict) else ""
    kind = "seq2seq" if "Seq2SeqLM" in model else "seq_cls" if "SequenceClassification" in model else domain
    family = vlm_stand_ins.family_of(model_id(data)) if domain == "vlm" else vision_language_family(data)
    if kind == "llm" and llm_family(data) and not family:
        kind = f"llm:{llm_family(data)}"
    if domain == "diffusion" and diffusion_family(data):
        kind = f"diffusion:{diffusion_family(data)}"
    found = dict(survey.hub_overrides(data, assets[kind]))
    inference = data.get("inference") if isinstance(data.get("inference"), dict) else {}
    if isinstance(inference.get("input_images"), list):  # an edit pipeline's pictures to edit: shipped ones
        shapes = sorted((Path(survey.local_assets()["diffusion"]["dataset"]) / "images").glob("*.png"))
        found["inference.input_images"] = json.dumps([str(path) for path in shapes[:len(inference["input_images"])]])
    if domain == "diffusion" and diffusion_family(data) and transformer_alone(data):
        found["data.dataloader.cache_dir"] = str(latent_cache(Path(assets[kind]["model"]), diffusion_family(data)))
        if data["data"]["dataloader"].get("base_resolution") is not None:  # what the cache holds
            found["data.dataloader.base_resolution"] = "[64, 64]"
    is_llm = kind == "llm" or kind.startswith("llm:")
    layers = max(pipeline_layers(data), draft_target_layers(data)) if is_llm else 0
    if eagle_target(data):  # the draft reads three distinct target layers: upstream's default needs 8
        found["recipe_args.target_model_name_or_path"] = assets[kind]["model"]
        layers = max(layers, 8)
        if isinstance(data["recipe_args"].get("draft_vocab_size"), int):  # within the stand-in's 1024 tokens
            found["recipe_args.draft_vocab_size"] = "256"
    sizes = layout_sizes(data, layers) if is_llm else {}
    if sizes:  # the family's stand-in with the sizes the layout needs (untied)
        config_class = FAMILIES[kind.split(":", 1)[1]] if ":" in kind else "LlamaConfig"
        name = "-".join(f"{key.split('_')[-1]}{value}" for key, value in sorted(sizes.items()))
        directory = Path(assets["llm"]["model"]).with_name(f"llm-{config_class}-{name}")
        if not directory.exists():
            write_tiny_llm(config_class, directory, Path(survey.local_assets()["llm"]["tokenizer"]), sizes)
        found |= {key: str(directory) for key, value in found.items() if value == assets[kind]["model"]}
    if family:  # the family's tiny model, its processor and tokenizer in the same directory
        directory = assets["vlm:families"][family]
        found |= {key: directory for key in found if key.rsplit(".", 1)[-1] in survey.HUB_KEYS and
                  survey.HUB_KEYS[key.rsplit(".", 1)[-1]] in ("model", "tokenizer", "processor")}
        drafter = vlm_stand_ins.family_of(str(data["model"].get("drafter_path", "")))
        if drafter:  # a Gemma 4 assistant trained beside its base: the one made for the base's stand-in
            found["model.drafter_path"] = assets["vlm:families"][drafter]
    if domain == "vlm" or family:  # the stand-in with the layers, experts and heads the layout needs
        standing = assets["vlm:families"][family] if family else assets["vlm"]["model"]
        sections = [data.get(name) for name in ("distributed", "teacher_distributed")]
        sizes = {key: max([node.get(key) for node in sections if isinstance(node, dict) and
                           isinstance(node.get(key), int)] or [1]) for key in ("ep_size", "tp_size")}
        sized = vlm_stand_ins.sized_for_layout(standing, pipeline_layers(data), sizes["ep_size"], sizes["tp_size"])
        found |= {key: sized for key, value in found.items() if value == standing}
    return found | drawn_vocabulary(data, found) | teacher_width(data, found)


def teacher_width(data: dict[str, Any], found: dict[str, str]) -> dict[str, str]:
    """A retrieval student's ``teacher_hidden_size`` (its projection to the teacher's embeddings, upstream's 4096) as
    the stand-in teacher's hidden size."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    teacher = Path(found.get("teacher_model.pretrained_model_name_or_path", ""), "config.json")
    if "teacher_hidden_size" not in model or not teacher.is_file():
        return {}
    return {"model.teacher_hidden_size": str(json.loads(teacher.read_text())["hidden_size"])}


def drawn_vocabulary(data: dict[str, Any], found: dict[str, str]) -> dict[str, str]:
    """``dataset.vocab_size`` of upstream's MockIterableDataset (set for the real checkpoint's vocabulary, or unset:
    1024) as the stand-in model's vocabulary, so the drawn token ids have embeddings."""
    dataset = data.get("dataset") if isinstance(data.get("dataset"), dict) else {}
    model = next((Path(value) for key, value in found.items() if key.startswith("model.")
                  and Path(value, "config.json").is_file()), None)
    if not str(dataset.get("_target_", "")).endswith("MockIterableDataset") or model is None:
        return {}
    config = json.loads((model / "config.json").read_text())
    return {"dataset.vocab_size": str((config.get("text_config") or config)["vocab_size"])}


def vision_language_family(data: dict[str, Any]) -> str | None:
    """The vlm_stand_ins family of a vision-language checkpoint that an LLM recipe's model section names (upstream's
    VLM benchmarks build Qwen3-VL-MoE with NeMoAutoModelForCausalLM.from_config), None for a text model."""
    ids = re.findall(r"[\w.-]+/[\w.-]+-VL-[\w.-]+", json.dumps(data.get("model") or {}))
    return next((vlm_stand_ins.family_of(hub) for hub in ids if vlm_stand_ins.family_of(hub)), None)


def model_id(data: dict[str, Any]) -> str:
    return str((data.get("model") or {}).get("pretrained_model_name_or_path", "")) \
        if isinstance(data.get("model"), dict) else ""


REMOVE = "<remove the key>"


def _adamw(old: Any) -> dict[str, Any]:
    """torch's AdamW with a fused Adam's lr / betas / eps / weight_decay (its other settings are its kernels')."""
    old = old if isinstance(old, dict) else {}
    return {"_target_": "torch.optim.AdamW", **{k: old[k] for k in ("lr", "betas", "eps", "weight_decay") if k in old}}


def _sdpa(old: Any) -> str:
    """sdpa, or eager where sdpa itself was refused (a model class transformers gives no SDPA attention)."""
    return "eager" if old == "sdpa" else "sdpa"


# --cpu: a key refused for a GPU-only feature (a regular expression; its group ``edit``, where it has one, names the
# key to change instead) -> the CPU alternative that the refusal message names (REMOVE: drop the key; a callable:
# the new value from the old one); None: trust_remote_code, which --trust-remote-code allows instead of an edit.
CPU_OVERRIDES: dict[str, Any] = {
    r"(^|\.)trust_remote_code$": None,
    r"^model\.backend\.attn$": _sdpa,
    r"^model\.backend\.(linear|experts|dispatcher|rope)$": "torch",
    r"^model\.backend\.rms_norm$": "torch_fp32",
    r"^model\.backend\.rope_fusion$": False,
    r"^(?P<edit>model\.backend\.(te_fp8|dispatcher_num_sms|mok))(\.|$)": REMOVE,
    r"(^|\.)_?attn_implementation(_new)?$": _sdpa,
    r"^model\.attention_backend$": "native",
    r"^model\.use_liger_kernel$": False,
    r"^(?P<edit>fp8)\.": REMOVE,
    r"^(?P<edit>(validation_)?dataloader\.collate_fn)(\.|$)": REMOVE,  # THD batches
    r"^packed_sequence\.packing_format$": "neat",
    r"^(?P<edit>loss_fn)\._target_$": REMOVE,  # Transformer Engine's cross entropy: the default loss
    r"^(?P<edit>optimizer)\._target_$": _adamw,
    r"^distributed\.strategy$": "fsdp2",
    r"^distributed\.(patch_is_packed_sequence|enable_async_tensor_parallel)$": False,
    r"^prewarm\.\w+$": False,
    r"^(?P<edit>quantization)(\.|$)": REMOVE,  # QLoRA: LoRA on the bf16 / fp32 weights
    r"^vae\.enable_cpu_offload$": False,
    r"^model\.optimize_hunyuan_flash_varlen_mask$": False,
    r"^model\.config\.kda_use_fused_gate$": False,  # flash-linear-attention's fused gate: Triton on CUDA
    r"^(?P<edit>model\.text_config\.cp_full_attn_backend)$": REMOVE,  # FFPA's CUDA kernels
    r"^(?P<edit>model\.transformer_engine_fp8\w*)$": REMOVE,
    r"^eagle3\.draft_attn_implementation$": ("recipe_args.draft_attn_implementation", "sdpa"),  # EAGLE-3's form
    r"^(dflash|dflash2|jetspec|domino|dspark)\.attention_backend$": (  # upstream's
        "recipe_args.attention_backend", "sdpa"),
}
# the words of a refusal for a GPU feature or trust_remote_code (and of sdpa refused for a model class without it,
# after the GPU attention gave way to sdpa)
CPU_REASONS = ("CUDA", "GPU", "--trust-remote-code", "attention in transformers")


def cpu_edit(issue: Any) -> tuple[str | None, Any] | None:
    """(the key to change, its CPU value) for a refusal that CPU_OVERRIDES answers; ``(None, None)`` for one that
    --trust-remote-code answers; None for any other refusal."""
    if not any(word in issue.message for word in CPU_REASONS):
        return None
    for pattern, value in CPU_OVERRIDES.items():
        if match := re.search(pattern, issue.key):
            if isinstance(value, tuple):  # (the key of the config's own form to change, its value)
                return value
            return (None, None) if value is None else (match.groupdict().get("edit") or issue.key, value)
    return None


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    if value == REMOVE:
        data.pop(last, None)
    else:
        data[last] = value(data.get(last)) if callable(value) else value


def cpu_config(path: Path, examples: Path, assets: dict[str, Any], scratch: Path) -> tuple[Path, str, list[Any]]:
    """--cpu: validate with --trust-remote-code and, while every refusal is one CPU_OVERRIDES answers, write a copy
    of the config into scratch with those edits and validate again: (the config to run, validation's words, its
    refusals)."""
    from automodel.config import dump_yaml, load_yaml_file

    current, data = path, load_yaml_file(path)
    domain = survey.domain_of(path.relative_to(examples).parts[0], path)
    for _ in range(6):  # an edit can bring a further refusal to light (the key it fell back on)
        with contextlib.chdir(examples.parent):
            validation, refused = survey.validate(current, list(stand_ins(data, assets, domain).items()),
                                                  ("--trust-remote-code",))
        edits = [cpu_edit(issue) for issue in refused]
        if not refused or None in edits:
            break
        for key, value in edits:
            if key is not None:
                set_key(data, key, value)
        current = scratch / path.name
        current.write_text(dump_yaml(data))
    return current, validation, refused


# The parallel sizes of a layout (the model's sections, a teacher's, upstream's diffusion fsdp: section; the
# benchmark's nodes).
LAYOUT_KEYS = {**{section: ("dp_size", "dp_replicate_size", "tp_size", "cp_size", "pp_size", "ep_size")
                  for section in ("distributed", "teacher_distributed", "fsdp")}, "benchmark": ("num_nodes",)}


def one_process_layout(data: dict[str, Any]) -> dict[str, str]:
    """``{dotted key: "1"}`` for every parallel size above 1 in the config, and a global batch of one local batch
    (the layout's global batch, 512 rows say, would make each step of one process hundreds of micro-batches)."""
    found = {f"{section}.{key}": "1" for section, keys in LAYOUT_KEYS.items()
             if isinstance(node := data.get(section), dict)
             for key in keys if isinstance(node.get(key), int) and node[key] > 1}
    steps = data.get("step_scheduler") if isinstance(data.get("step_scheduler"), dict) else {}
    if isinstance(steps.get("global_batch_size"), int) and isinstance(steps.get("local_batch_size"), int):
        found["step_scheduler.global_batch_size"] = str(steps["local_batch_size"])
    return found


def laid_out_for_more(validation: str, max_processes: int) -> bool:
    world = re.search(r"checked for (\d+) process", validation)
    return world is not None and int(world.group(1)) > max_processes


def launch_args(validation: str, max_processes: int = 4) -> list[str]:
    """The route and process count that validation chose (``valid for ROUTE (checked for N processes``): a
    config without ``recipe:`` runs through its route's command, a layout of 2 to ``max_processes`` processes on
    that many (one machine, gloo); a bigger one runs on one process and is refused for its layout."""
    route = re.search(r"valid for ([a-z]+ [a-z]+) \(", validation)
    world = re.search(r"checked for (\d+) process", validation)
    args = route.group(1).split() if route else ["run"]
    if world and 2 <= int(world.group(1)) <= max_processes:
        args += ["--nproc-per-node", world.group(1), "--master-port", str(free_port())]
    return args


def data_overrides(data: dict[str, Any], root: Path, scratch: Path) -> dict[str, str]:
    """``{dotted key: local file}`` for every data set section whose form has a local file here; a diffusion
    loader's ``cache_dir``: the tiny clips for a video family, the shipped shapes pictures for an image one."""
    found = {}
    loader = (data.get("data") or {}).get("dataloader") if isinstance(data.get("data"), dict) else None
    family = diffusion_family(data)
    if isinstance(loader, dict) and "cache_dir" in loader and family and family != "Qwen-Image-Edit" and \
            not transformer_alone(data):  # (a latent cache: stand_ins)
        found["data.dataloader.cache_dir"] = str(root.parent / "models" / "clips") if family in VIDEO_FAMILIES \
            else str(Path(survey.local_assets()["diffusion"]["dataset"]))
    if isinstance(loader, dict) and loader.get("base_resolution") is not None:
        found["data.dataloader.base_resolution"] = "[64, 64]"  # the tiny VAE halves a side: 512 x 512 is 16k tokens
    shape = ((data.get("flow_matching") or {}).get("adapter_kwargs") or {}).get("default_image_embed_shape")
    transformer = root.parent / "models" / str(family) / "transformer" / "config.json"
    if isinstance(shape, list) and len(shape) == 2 and transformer.is_file():  # HunyuanVideo: the tiny one's width
        width = json.loads(transformer.read_text()).get("image_embed_dim")
        found["flow_matching.adapter_kwargs.default_image_embed_shape"] = f"[{shape[0]}, {width}]"
    found |= vlm_stand_ins.mix_overrides(data, root)
    if isinstance(args := data.get("recipe_args"), dict):  # EAGLE: chat rows, files into scratch
        chat = Path(survey.local_assets()["llm"]["dataset"]).with_name("tiny_chat")
        for key, split, name in (("train_data_path", "train_split", "train"), ("val_data_path", "val_split",
                                                                                "validation")):
            if args.get(key) is not None:
                found[f"recipe_args.{key}"] = str(chat / f"{name}.jsonl")
                found[f"recipe_args.{split}"] = "train"
        for key in ("output_dir", "selected_token_ids_path"):
            if args.get(key) is not None:
                found[f"recipe_args.{key}"] = str(scratch / key)
    for section, node in data.items():
        if not str(section).startswith(("dataset", "validation_dataset", "tool_call_eval")) or \
                not isinstance(node, dict):
            continue
        key = next((k for k in PATH_KEYS if k in node), None)
        factory = str(node.get("_target_", "")).rsplit(".", 1)[-1]
        if factory == "MegatronPretraining":  # Megatron's indexed files of a small corpus
            found[f"{section}.paths"] = str(root / "megatron_text_document")
            found[f"{section}.index_mapping_dir"] = str(scratch / "megatron_index")
        if factory == "GLUE_MRPC":  # a hub data set by a fixed name: the general form of its rows, from a file
            found |= {f"{section}._target_": "automodel_llm.datasets.SequenceClassificationDataset",
                      f"{section}.path_or_dataset_id": str(root / "mrpc.jsonl"),
                      f"{section}.text_fields": "[sentence1, sentence2]"}
        if factory == "NanogptDataset":
            found[f"{section}.file_pattern"] = str(root / "nanogpt_*.bin")
        if key is None:
            continue
        if factory in DATA_FILES:
            found[f"{section}.{key}"] = str(root / DATA_FILES[factory])
            split = node.get("split")
            if isinstance(split, str) and "[" in split:  # row numbers of upstream's data, not of the small file
                found[f"{section}.split"] = split.split("[", 1)[0]
        elif factory == "ColumnMappedTextInstructionDataset":
            columns = list((node.get("column_mapping") or {}).values())
            found[f"{section}.{key}"] = _write_jsonl(scratch / f"{section}.jsonl", [
                {column: f"{column} number {k}" for column in columns} for k in range(32)])
    return found


def run_file(path: Path, domain: str, examples: Path, assets: dict[str, Any], data_root: Path, steps: int,
             scratch: Path, validation: str, flags: tuple[str, ...] = (), max_processes: int = 4,
             one_process: bool = False) -> tuple[int | str, str]:
    from automodel.config import load_yaml_file

    data = load_yaml_file(path)
    overrides = stand_ins(data, assets, domain)
    overrides.update(data_overrides(data, data_root, scratch))
    if one_process and laid_out_for_more(validation, max_processes):
        overrides.update(one_process_layout(data))
    args = [sys.executable, "-m", "automodel.cli.main", *launch_args(validation, max_processes), *flags,
            "-c", str(path)]
    for key, value in overrides.items():
        args += [f"--{key}", value]
    if "generate" in args:  # a generation config: ``steps`` denoising steps of a small picture, into scratch
        args += ["--inference.num_inference_steps", str(steps), "--inference.height", "64", "--inference.width", "64",
                 "--output.output_dir", str(scratch / "out")]
        if "num_frames" in ((data.get("inference") or {}).get("pipeline_kwargs") or {}):
            args += ["--inference.pipeline_kwargs.num_frames", "5"]
    else:
        args += ["--step_scheduler.max_steps", str(steps), "--checkpoint.checkpoint_dir", str(scratch / "ckpt")]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    try:
        done = subprocess.run(args, cwd=examples.parent, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    lines = done.stderr.splitlines()
    errors = [line for line in lines if line.startswith(("error", "  - "))][:6]
    if done.returncode != 0 and any(line.startswith("Traceback") for line in lines):  # a crash, not a refusal
        errors += ["(the run's last lines:)", *lines[-8:]]
    return done.returncode, "\n".join(errors)


def main() -> int:
    from automodel.config import load_yaml_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=Path, help="upstream examples/ directory")
    parser.add_argument("--steps", type=int, default=2, help="step_scheduler.max_steps of each run")
    parser.add_argument("--only", nargs="*", default=[], help="run only files whose path contains one of these")
    parser.add_argument("--max-processes", type=int, default=4, help="the largest layout run on its own number of "
                        "processes (gloo ranks on this machine's cores); a bigger one runs on one process")
    parser.add_argument("--folders", nargs="*", default=[*survey.FOLDERS, "llm_seq_cls"],
                        help="sub-folders of examples/ to run")
    parser.add_argument("--one-process", action="store_true", help="run a config laid out for more than "
                        "--max-processes in one process, its parallel sizes set to 1")
    parser.add_argument("--cpu", action="store_true", help="run a config refused only for GPU features or "
                        "trust_remote_code with the CPU alternatives its refusals name and --trust-remote-code")
    parser.add_argument("--validate-only", action="store_true", help="count the configs that would run (with "
                        "--cpu: after the CPU alternatives), without running them")
    args = parser.parse_args()
    examples = args.examples.resolve()
    ran = passed = surveyed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        (root / "models").mkdir()
        write_data(root / "data")
        assets = write_models(root / "models")
        for folder in args.folders:
            for path in sorted(p for p in (examples / folder).rglob("*") if p.suffix in (".yaml", ".yml")):
                name = str(path.relative_to(examples))
                if args.only and not any(part in name for part in args.only):
                    continue
                surveyed += 1
                scratch = root / "runs" / name.replace("/", "__")
                scratch.mkdir(parents=True)
                config = path
                if args.cpu:
                    config, validation, refused = cpu_config(path, examples, assets, scratch)
                    if refused:  # refused for something a CPU alternative does not answer
                        print(f"{name}: skipped: {next(i for i in refused if cpu_edit(i) is None)}", flush=True)
                        continue
                else:
                    hub = list(stand_ins(load_yaml_file(path), assets, survey.domain_of(folder, path)).items())
                    with contextlib.chdir(examples.parent):
                        validation, refused = survey.validate(path, hub)
                    if refused:
                        continue  # refused at validation: check_upstream_configs.py says why
                ran += 1
                if args.validate_only:
                    print(f"{name}: validates" + (" (CPU alternatives)" if config != path else ""), flush=True)
                    continue
                domain = survey.domain_of(folder, path)
                code, errors = run_file(config, domain, examples, assets, root / "data", args.steps, scratch,
                                        validation, ("--trust-remote-code",) if args.cpu else (), args.max_processes,
                                        args.one_process)
                passed += code == 0
                print(f"{name}: exit {code}" + (f"\n{errors}" if code != 0 and errors else ""), flush=True)
    if args.validate_only:
        print(f"\n=== {ran} of {surveyed} configs validate" + (" (--cpu: with the CPU alternatives)" if args.cpu
                                                             else "") + " ===")
    else:
        print(f"\n=== {passed} of {ran} configs that validate ran {args.steps} steps ===")
    return 0


if __name__ == "__main__":
    sys.exit(main())
