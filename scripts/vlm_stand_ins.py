"""Tiny local stand-ins of the VLM families that upstream's example configs name by hub id, for
``run_upstream_configs.py``: a saved directory per family (fresh weights, safetensors, and its processor beside
them, as a hub download holds), so that a config runs its family's own model and processor code here instead of the
generic tiny Llava. Also the local files of the VLM data set forms that ``run_upstream_configs.py`` itself does not
write (RDR's ``{image, text}``, Tulu-3's ``{messages}``, Magicoder's ``{problem, solution}``).

The models and processors are the ones the VLM tests build (``automodel-vlm/tests``: ``test_video.tiny_model_dir``
and ``tiny_qwen_processor``, ``vlm_context_parallel_workers.tiny_model`` and ``tiny_qwen3_config``,
``vlm_testing.tiny_gemma3_dir`` and ``tiny_gemma4_dir``, ``test_family_processors.tiny_mistral3_dir``). A hub id
matching none of ``FAMILIES`` keeps the tiny Llava.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "automodel-vlm" / "tests"))


def _save(model_config: Any, processor: Any, path: Path) -> Path:
    from automodel_vlm import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_config(model_config, seed=0).save_pretrained(path)
    processor.save_pretrained(str(path))
    return path


def _qwen3(family: str) -> Callable[[Path], Path]:
    """Qwen3-VL / Qwen3.5, dense (the video tests' saved model) or MoE (the context-parallel tests' config)."""
    def build(path: Path) -> Path:
        import test_video

        if not family.endswith("_moe"):
            return test_video.tiny_model_dir(path.parent, family).rename(path)
        from vlm_context_parallel_workers import tiny_qwen3_config

        return _save(tiny_qwen3_config(family)[1], test_video.tiny_qwen_processor(), path)
    return build


def _qwen2_5_vl(path: Path) -> Path:
    """The context-parallel tests' Qwen2.5-VL config; transformers' Qwen2.5-VL processor of the video tests' parts."""
    from test_video import tiny_qwen_processor
    from transformers import Qwen2_5_VLProcessor
    from vlm_context_parallel_workers import tiny_model

    from automodel_vlm.video_processors import Qwen2VLVideoProcessorPil

    base = tiny_qwen_processor()
    processor = Qwen2_5_VLProcessor(image_processor=base.image_processor, tokenizer=base.tokenizer,
                                    video_processor=Qwen2VLVideoProcessorPil(patch_size=8),
                                    chat_template=base.chat_template)
    return _save(tiny_model("qwen2_5_vl")[0].config, processor, path)


def _gemma3(path: Path) -> Path:
    from vlm_testing import tiny_gemma3_dir

    return tiny_gemma3_dir(path)


def _gemma4(path: Path) -> Path:
    from vlm_testing import tiny_gemma4_dir

    return tiny_gemma4_dir(path)


def _gemma4_assistant(path: Path) -> Path:
    """A tiny Gemma 4 assistant (drafter) made for the tiny Gemma 4 of ``_gemma4`` (built beside it to read its text
    config): the base's hidden size as its backbone's, the base's vocabulary, two layers sharing the base's keys
    and values."""
    from transformers import AutoConfig, Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    base = AutoConfig.from_pretrained(str(_gemma4(path.with_name(path.name + "_base")))).text_config
    text = {key: value for key, value in base.to_dict().items() if key != "layer_types"}  # 2 layers: their own
    text.update(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_kv_shared_layers=2,
                vocab_size_per_layer_input=0, hidden_size_per_layer_input=0)
    Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=base.hidden_size)
                               ).save_pretrained(path)
    return path


def _rebuilt(source: Path, path: Path, text_changes: dict[str, Any],
             vision_changes: dict[str, Any] | None = None) -> Path:
    """``source``'s stand-in with its text model's config changed (fresh weights) and its other files (processor,
    tokenizer) copied: a per-layer list of the text config follows a new layer count, repeating its pattern, and the
    head size stays where the head count changes; ``vision_changes`` change its vision tower's config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source))
    for key, value in (vision_changes or {}).items():
        setattr(config.vision_config, key, value)
    text = config.get_text_config()
    layers = text_changes.get("num_hidden_layers")
    if layers:
        old = text.num_hidden_layers
        for key, value in vars(text).items():
            if isinstance(value, list) and len(value) == old:
                setattr(text, key, [value[i % old] for i in range(layers)])
    if "num_attention_heads" in text_changes and getattr(text, "head_dim", None) is None:
        text.head_dim = text.hidden_size // text.num_attention_heads
    for key, value in text_changes.items():
        setattr(text, key, value)
    from automodel_vlm import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_config(config, seed=0).save_pretrained(path)
    for item in source.iterdir():  # all but the weights (and their index) and the config
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json" \
                and not item.name.startswith("model.safetensors"):
            shutil.copy(item, path)
    return path


def _gemma4_moe(path: Path) -> Path:
    """The tiny Gemma 4 with a mixture-of-experts block in each layer (the 26B-A4B's form: 8 experts, 2 a token)."""
    dense = _gemma4(path.with_name(path.name + "_dense"))
    return _rebuilt(dense, path, {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                                  "moe_intermediate_size": 16})


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def sized_for_layout(directory: str, layers: int, ep_size: int, tp_size: int) -> str:
    """A family stand-in (``directory``) that a config's layout fits: at least ``layers`` text layers (its pipeline
    stages'), experts that ``ep_size`` divides, attention / key-value heads (a sharded vision tower's too) and
    vocabulary that ``tp_size`` divides;
    ``directory`` itself where it fits, else a copy so changed beside it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    text = config.get_text_config()
    changes: dict[str, int] = {"num_hidden_layers": layers} if layers > text.num_hidden_layers else {}
    for key in _EXPERT_COUNTS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value and value % ep_size:
            changes[key] = math.lcm(value, ep_size)
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value % tp_size:
            changes[key] = math.lcm(value, tp_size)
    if text.vocab_size % tp_size:
        changes["vocab_size"] = -(-text.vocab_size // tp_size) * tp_size
    vision = getattr(config, "vision_config", None)
    tower: dict[str, int] = {}  # a vision tower with a tensor-parallel plan of its own (Gemma 4's) is sharded too
    for key in ("num_attention_heads", "num_key_value_heads") if getattr(vision, "base_model_tp_plan", None) else ():
        value = getattr(vision, key, None)
        if isinstance(value, int) and value % tp_size:
            tower[key] = math.lcm(value, tp_size)
    if not changes and not tower:
        return directory
    named = [*(f"{key}{value}" for key, value in sorted(changes.items())),
             *(f"vision_{key}{value}" for key, value in sorted(tower.items()))]
    path = Path(directory + "-" + "-".join(named))
    return str(path if path.exists() else _rebuilt(Path(directory), path, changes, tower))


def _mistral3(path: Path) -> Path:
    """A tiny Mistral 3 (Pixtral tower, Mistral text model) with its PixtralProcessor."""
    from test_family_processors import tiny_mistral3_dir

    return tiny_mistral3_dir(path)


# a pattern of an upstream hub model id (the first that matches) -> the builder of its family's tiny stand-in
FAMILIES: dict[str, Callable[[Path], Path]] = {
    r"Qwen3-VL-.*-A\d+B": _qwen3("qwen3_vl_moe"), r"Qwen3-VL": _qwen3("qwen3_vl"),
    r"Qwen3\.[5-9]-.*-A\d+B": _qwen3("qwen3_5_moe"), r"Qwen3\.[5-9]-": _qwen3("qwen3_5"),
    r"Qwen2\.5-VL": _qwen2_5_vl, r"gemma-3-\d": _gemma3, r"gemma-4-.*-assistant": _gemma4_assistant,
    r"gemma-4-\d+[bB]-[aA]\d+[bB]": _gemma4_moe, r"gemma-4-": _gemma4, r"Ministral-3-": _mistral3,
}


def family_of(hub_id: str) -> str | None:
    """The pattern of ``FAMILIES`` that ``hub_id`` matches, or None."""
    return next((pattern for pattern in FAMILIES if re.search(pattern, hub_id)), None)


def write_family_models(root: Path) -> dict[str, str]:
    """Every family's tiny stand-in saved under ``root``: ``{pattern: directory}``."""
    root.mkdir(parents=True, exist_ok=True)
    return {pattern: str(build(root / re.sub(r"\W+", "_", pattern).strip("_")))
            for pattern, build in FAMILIES.items()}


# upstream data set factory (last name of its _target_) -> the local file written by write_vlm_data
DATA_FILES = {"make_rdr_dataset": "rdr.jsonl", "make_tulu3_dataset": "tulu.jsonl"}
_MIX = "make_tulu3_magicoder_text_mix_dataset"


def write_vlm_data(root: Path, medpix: Path) -> None:
    """RDR rows (the MedPix file's pictures, a caption each), Tulu-3 and Magicoder rows (the VLM tests')."""
    from vlm_testing import magicoder_rows, tulu_rows

    pictures = [json.loads(line)["image_id"] for line in medpix.read_text().splitlines()]
    rows = {"rdr.jsonl": [{"image": image, "text": f"a shape, number {k}"} for k, image in enumerate(pictures)],
            "tulu.jsonl": tulu_rows(32), "magicoder.jsonl": magicoder_rows(8)}
    for name, lines in rows.items():
        (root / name).write_text("".join(json.dumps(line) + "\n" for line in lines))


def mix_overrides(data: dict[str, Any], root: Path) -> dict[str, str]:
    """``{dotted key: local file}`` for the Tulu-3 / Magicoder mix sections (their hub ids are defaults, not keys)."""
    return {f"{section}.{kind}_path_or_dataset": str(root / f"{kind}.jsonl") for section, node in data.items()
            if isinstance(node, dict) and str(node.get("_target_", "")).endswith(_MIX)
            for kind in ("tulu", "magicoder")}
