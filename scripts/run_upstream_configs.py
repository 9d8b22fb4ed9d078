"""Run upstream's example configs for a few steps on this machine: the ones ``automodel validate`` passes.

A developer tool beside ``check_upstream_configs.py`` (which validates them), reading a local copy of upstream's
``examples/`` directory (nothing upstream is kept here):

    .venv/bin/python scripts/run_upstream_configs.py /path/to/upstream/examples --steps 2 [--only NAME ...]

Each config runs as a user without network would run it: ``automodel run -c FILE`` from upstream's repository root,
every hub model / tokenizer / processor id overridden with a tiny local model of that domain (fresh weights, the
shipped tokenizer or processor), every data set path with a small local file in the columns its ``_target_`` reads
(SQuAD, HellaSwag, chat, xLAM, column-mapped, MedPix, CORD-v2, Shopify), ``step_scheduler.max_steps`` and a
scratch ``checkpoint.checkpoint_dir``. Nothing else changes, so a config laid out for more processes than one
(tp_size 8, say) is refused by the run for that. It prints each file's exit status and, for a failure, the run's
last error lines, then the count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import check_upstream_configs as survey  # noqa: E402  (the validation survey: hub keys, domains, validation)

# upstream data set factory (last name of its _target_) -> the local file written for it
DATA_FILES = {"HellaSwag": "hellaswag.jsonl", "ChatDataset": "chat.jsonl", "make_agent_chat_dataset": "chat.jsonl",
              "make_xlam_dataset": "xlam.jsonl", "make_medpix_dataset": "medpix.jsonl",
              "make_cord_v2_dataset": "cord.jsonl", "make_shopify_product_catalogue_dataset": "shopify.jsonl",
              "ToolCallAccuracyEvaluator": "tool_calls.jsonl"}
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


def write_models(root: Path) -> dict[str, dict[str, str]]:
    """Per domain, the validation survey's local assets with the LLM and VLM model ids pointing at a saved model
    (fresh weights, safetensors) whose directory also holds the tokenizer / processor, as a hub download does."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

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
    for domain, directory in (("llm", llm), ("vlm", vlm)):
        assets[domain] = {kind: str(directory) for kind in ("model", "tokenizer", "processor")} | {
            "dataset": assets[domain]["dataset"]}
    return assets


def data_overrides(data: dict[str, Any], root: Path, scratch: Path) -> dict[str, str]:
    """``{dotted key: local file}`` for every data set section whose form has a local file here."""
    found = {}
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
             scratch: Path) -> tuple[int | str, str]:
    from automodel.config import load_yaml_file

    data = load_yaml_file(path)
    overrides = dict(survey.hub_overrides(data, assets[survey.domain_of(path.relative_to(examples).parts[0])]))
    overrides.update(data_overrides(data, data_root, scratch))
    args = [sys.executable, "-m", "automodel.cli.main", "run", "-c", str(path)]
    for key, value in overrides.items():
        args += [f"--{key}", value]
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
                hub = list(survey.hub_overrides(load_yaml_file(path), assets[survey.domain_of(folder)]))
                with contextlib.chdir(examples.parent):
                    if survey.validate(path, hub)[1]:
                        continue  # refused at validation: check_upstream_configs.py says why
                ran += 1
                scratch = root / "runs" / name.replace("/", "__")
                scratch.mkdir(parents=True)
                code, errors = run_file(path, examples, assets, root / "data", args.steps, scratch)
                passed += code == 0
                print(f"{name}: exit {code}" + (f"\n{errors}" if code != 0 and errors else ""), flush=True)
    print(f"\n=== {passed} of {ran} configs that validate ran {args.steps} steps ===")
    return 0


if __name__ == "__main__":
    sys.exit(main())
