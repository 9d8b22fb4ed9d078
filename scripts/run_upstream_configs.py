"""Run upstream's example configs for a few steps on this machine: the ones ``automodel validate`` passes.

A developer tool beside ``check_upstream_configs.py`` (which validates them), reading a local copy of upstream's
``examples/`` directory (nothing upstream is kept here):

    .venv/bin/python scripts/run_upstream_configs.py /path/to/upstream/examples --steps 2 [--only NAME ...]

Each config runs as a user without network would run it: ``automodel run -c FILE`` from upstream's repository root
(a config without ``recipe:``, such as a generation config, through the route validation chose: ``automodel
generate diffusion -c FILE``), every hub model / tokenizer / processor id overridden with a tiny local model of that
domain (fresh weights, the shipped tokenizer or processor; a sequence-to-sequence model gets a tiny T5, a diffusion
model the diffusion tests' tiny pipeline of its family), every data set path with a small local file in the columns
its ``_target_`` reads (SQuAD, HellaSwag, chat, tool calls, xLAM, column-mapped, MedPix, CORD-v2, Shopify; tiny
clips or the shipped shapes pictures for a diffusion loader), ``step_scheduler.max_steps`` and a scratch
``checkpoint.checkpoint_dir``. A generation config makes ``--steps`` denoising steps of 64 x 64 pictures (5 frames
for a video) into a scratch ``output.output_dir``. A config laid out for 2 to 4 processes runs on that many
(``--nproc-per-node``, gloo); nothing else changes, so a config laid out for more (tp_size 8, say) is refused by
the run for that. It prints each file's exit status and, for a failure, the run's last error lines, then the count.
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

from automodel.testing import free_port  # noqa: E402

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
    vlm_stand_ins.write_vlm_data(root, root / "medpix.jsonl")


def write_models(root: Path) -> dict[str, dict[str, str]]:
    """Per domain, the validation survey's local assets with the LLM and VLM model ids pointing at a saved model
    (fresh weights, safetensors) whose directory also holds the tokenizer / processor, as a hub download does."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

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


def diffusion_family(data: dict[str, Any]) -> str | None:
    """The family (a key of DIFFUSION_FAMILIES) of a diffusion config's hub model id."""
    model = str((data.get("model") or {}).get("pretrained_model_name_or_path", ""))
    return next((name for name in DIFFUSION_FAMILIES if name in model), None)


def stand_ins(data: dict[str, Any], assets: dict[str, dict[str, str]], domain: str) -> dict[str, str]:
    """The hub-id overrides of the validation survey; a sequence-to-sequence model (and its tokenizer) gets the
    tiny T5 stand-in instead of the domain's decoder."""
    model = str((data.get("model") or {}).get("_target_", "")) if isinstance(data.get("model"), dict) else ""
    kind = "seq2seq" if "Seq2SeqLM" in model else domain
    if domain == "diffusion" and diffusion_family(data):
        kind = f"diffusion:{diffusion_family(data)}"
    found = dict(survey.hub_overrides(data, assets[kind]))
    family = vlm_stand_ins.family_of(model_id(data)) if domain == "vlm" else None
    if family:  # the family's tiny model, its processor and tokenizer in the same directory
        directory = assets["vlm:families"][family]
        found |= {key: directory for key in found if key.rsplit(".", 1)[-1] in survey.HUB_KEYS and
                  survey.HUB_KEYS[key.rsplit(".", 1)[-1]] in ("model", "tokenizer", "processor")}
    return found


def model_id(data: dict[str, Any]) -> str:
    return str((data.get("model") or {}).get("pretrained_model_name_or_path", "")) \
        if isinstance(data.get("model"), dict) else ""


def launch_args(validation: str) -> list[str]:
    """The route and process count that validation chose (``valid for ROUTE (checked for N processes``): a
    config without ``recipe:`` runs through its route's command, a layout of 2 to 4 processes on that many
    (one machine, gloo); a bigger one runs on one process and is refused for its layout."""
    route = re.search(r"valid for ([a-z]+ [a-z]+) \(", validation)
    world = re.search(r"checked for (\d+) process", validation)
    args = route.group(1).split() if route else ["run"]
    if world and 2 <= int(world.group(1)) <= 4:
        args += ["--nproc-per-node", world.group(1), "--master-port", str(free_port())]
    return args


def data_overrides(data: dict[str, Any], root: Path, scratch: Path) -> dict[str, str]:
    """``{dotted key: local file}`` for every data set section whose form has a local file here; a diffusion
    loader's ``cache_dir``: the tiny clips for a video family, the shipped shapes pictures for an image one."""
    found = {}
    loader = (data.get("data") or {}).get("dataloader") if isinstance(data.get("data"), dict) else None
    family = diffusion_family(data)
    if isinstance(loader, dict) and "cache_dir" in loader and family and family != "Qwen-Image-Edit":
        found["data.dataloader.cache_dir"] = str(root.parent / "models" / "clips") if family in VIDEO_FAMILIES \
            else str(Path(survey.local_assets()["diffusion"]["dataset"]))
    found |= vlm_stand_ins.mix_overrides(data, root)
    for section, node in data.items():
        if not str(section).startswith(("dataset", "validation_dataset", "tool_call_eval")) or \
                not isinstance(node, dict):
            continue
        key = next((k for k in PATH_KEYS if k in node), None)
        factory = str(node.get("_target_", "")).rsplit(".", 1)[-1]
        if key is None:
            continue
        if factory in DATA_FILES:
            found[f"{section}.{key}"] = str(root / DATA_FILES[factory])
        elif factory == "ColumnMappedTextInstructionDataset":
            columns = list((node.get("column_mapping") or {}).values())
            found[f"{section}.{key}"] = _write_jsonl(scratch / f"{section}.jsonl", [
                {column: f"{column} number {k}" for column in columns} for k in range(32)])
    return found


def run_file(path: Path, examples: Path, assets: dict[str, Any], data_root: Path, steps: int,
             scratch: Path, validation: str) -> tuple[int | str, str]:
    from automodel.config import load_yaml_file

    data = load_yaml_file(path)
    overrides = stand_ins(data, assets, survey.domain_of(path.relative_to(examples).parts[0]))
    overrides.update(data_overrides(data, data_root, scratch))
    args = [sys.executable, "-m", "automodel.cli.main", *launch_args(validation), "-c", str(path)]
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
    errors = [line for line in done.stderr.splitlines() if line.startswith(("error", "  - "))]
    return done.returncode, "\n".join(errors[:6])


def main() -> int:
    from automodel.config import load_yaml_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=Path, help="upstream examples/ directory")
    parser.add_argument("--steps", type=int, default=2, help="step_scheduler.max_steps of each run")
    parser.add_argument("--only", nargs="*", default=[], help="run only files whose path contains one of these")
    args = parser.parse_args()
    examples = args.examples.resolve()
    ran = passed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        (root / "models").mkdir()
        write_data(root / "data")
        assets = write_models(root / "models")
        for folder in survey.FOLDERS:
            for path in sorted(p for p in (examples / folder).rglob("*") if p.suffix in (".yaml", ".yml")):
                name = str(path.relative_to(examples))
                if args.only and not any(part in name for part in args.only):
                    continue
                hub = list(stand_ins(load_yaml_file(path), assets, survey.domain_of(folder)).items())
                with contextlib.chdir(examples.parent):
                    validation, refused = survey.validate(path, hub)
                if refused:
                    continue  # refused at validation: check_upstream_configs.py says why
                ran += 1
                scratch = root / "runs" / name.replace("/", "__")
                scratch.mkdir(parents=True)
                code, errors = run_file(path, examples, assets, root / "data", args.steps, scratch, validation)
                passed += code == 0
                print(f"{name}: exit {code}" + (f"\n{errors}" if code != 0 and errors else ""), flush=True)
    print(f"\n=== {passed} of {ran} configs that validate ran {args.steps} steps ===")
    return 0


if __name__ == "__main__":
    sys.exit(main())
