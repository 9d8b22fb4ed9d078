"""Survey: which upstream NeMo AutoModel example configs pass ``automodel validate``, and why the others do not.

A developer tool (it reads a local copy of upstream's ``examples/`` directory; nothing upstream is kept here):

    .venv/bin/python scripts/check_upstream_configs.py /path/to/upstream/examples > survey.txt

For every YAML under the surveyed folders it runs ``automodel validate -c FILE`` in-process, exactly as the CLI
does (route from ``recipe:``, else the best-fitting installed recipe). Where validation refuses a key naming a hub
model or data set by id (unreachable offline), every hub id is overridden with a local tiny asset shipped with
this project, as a user without network would. It validates from the directory above ``examples/`` (upstream's
repository root, where upstream runs its examples), so relative paths in the configs resolve as there. It prints
PASS or each refusal per file, then a summary grouping refusals by cause (the message with names and numbers
blanked out), and the ``_target_`` names the examples use with the dotted path each expands to here.

When ``recipe:`` names something that cannot be resolved at all, validation stops at that one issue; the tool
then validates the config again without ``recipe:`` (best fit) and lists those refusals too, marked ``[best fit]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

FOLDERS = ("llm_finetune", "llm_pretrain", "llm_kd", "llm_benchmark", "vlm_finetune", "retrieval", "diffusion")

# Keys whose value names a hub repository (org/name); the local stand-in is an asset shipped with our packages.
HUB_KEYS = {
    "pretrained_model_name_or_path": "model",
    "model_name_or_path": "model",
    "name_or_path": "model",  # a config node's checkpoint (from_config with load_base_model)
    "model_id": "model",
    "tokenizer_name_or_path": "tokenizer",
    "processor_name_or_path": "processor",
    "dataset_name": "dataset",
    "path_or_dataset_id": "dataset",
    "path_or_dataset": "dataset",
    "data_files": "dataset",
    "data_dir_list": "dataset",
}
# A token id of the hub model's tokenizer (a diffusion LM's mask token) stands for the local tokenizer's <unk>.
STANDIN_TOKEN_IDS = {"mask_token_id": "3"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # a canonical id has no namespace: roberta-large


def local_assets() -> dict[str, dict[str, str]]:
    """Per domain: the local tiny asset that stands in for a hub model / tokenizer / processor / data set."""
    from importlib.resources import files

    def kinds(package: str, model: str, tokenizer: str, processor: str, dataset: str) -> dict[str, str]:
        root = files(package).joinpath("examples", "assets")
        names = {"model": model, "tokenizer": tokenizer, "processor": processor, "dataset": dataset}
        return {kind: str(root.joinpath(name)) for kind, name in names.items()}

    return {"llm": kinds("automodel_llm", "tiny_llama", "tiny_tokenizer", "tiny_tokenizer", "tiny_squad"),
            "vlm": kinds("automodel_vlm", "tiny_llava", "tiny_tokenizer", "tiny_image_processor", "tiny_shapes"),
            "retrieval": kinds("automodel_retrieval", "tiny_bert", "tiny_tokenizer", "tiny_tokenizer",
                               "tiny_retrieval"),
            "diffusion": kinds("automodel_diffusion", "tiny_flow", "tiny_flow", "tiny_flow", "tiny_shapes")}


def hub_overrides(data: Any, assets: dict[str, str], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, local path)`` for every value that names a hub id which is not a local path, and every model,
    tokenizer or processor location left for the user to fill in (``<your_path>``, ``/path/to/model``)."""
    from automodel.config.model_paths import missing_location

    if isinstance(data, dict):
        for key, value in data.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            kind = HUB_KEYS.get(str(key))
            placeholder = kind in ("model", "tokenizer", "processor") and missing_location(value)
            if key == "data_dir_list":  # retrieval data files: the shipped rows, where one is not here
                if _unreachable_files(value):
                    yield dotted, f"[{Path(assets['dataset']) / 'train.jsonl'}]"
            elif key in STANDIN_TOKEN_IDS and isinstance(value, int):
                yield dotted, STANDIN_TOKEN_IDS[str(key)]
            elif kind and isinstance(value, str) and (_HUB_ID.match(value) or placeholder) \
                    and not Path(value).exists():
                yield dotted, assets[kind]
                if kind == "dataset" and data.get("revision") is not None:  # a hub version: the local file has none
                    yield f"{prefix}.revision" if prefix else "revision", "null"
            else:
                yield from hub_overrides(value, assets, dotted)
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from hub_overrides(value, assets, f"{prefix}.{index}")


def _unreachable_files(data_dir_list: Any) -> bool:
    """Whether a retrieval ``data_dir_list`` names a file on the hub (``hf://``) or one that is not here."""
    entries = data_dir_list if isinstance(data_dir_list, list) else [data_dir_list]
    paths = [entry.get("path") if isinstance(entry, dict) else entry for entry in entries]
    return any(isinstance(path, str) and (path.startswith("hf://") or not Path(path).is_file()) for path in paths)


def validate(path: Path, overrides: list[tuple[str, str]], flags: tuple[str, ...] = ()) -> tuple[str, list[Any]]:
    """Run ``automodel validate [flags] -c path --k v ...`` in-process: (what it printed, the issues it refused
    with)."""
    from automodel.cli.main import cli
    from automodel.errors import AutomodelError, ConfigError, ConfigIssue

    args = ["validate", *flags, "-c", str(path)]
    for key, value in overrides:
        args += [f"--{key}", value]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            cli.main(args=args, prog_name="automodel", standalone_mode=False)
    except ConfigError as err:
        return out.getvalue().strip(), err.issues
    except AutomodelError as err:
        return out.getvalue().strip(), [ConfigIssue("", f"{type(err).__name__}: {err}")]
    except Exception as err:  # the survey reports a crash as a refusal instead of stopping
        return out.getvalue().strip(), [ConfigIssue("", f"crash {type(err).__name__}: {err}")]
    return out.getvalue().strip(), []


def recipe_unresolvable(issues: list[Any]) -> bool:
    return len(issues) == 1 and issues[0].key.startswith("recipe") and "_target_ " not in issues[0].message


def without_recipe(path: Path, workdir: Path) -> Path:
    """The same config with its top-level ``recipe:`` removed (a scratch file outside the repository)."""
    from automodel.config import dump_yaml, load_yaml_file

    data = {k: v for k, v in load_yaml_file(path).items() if k != "recipe"}
    scratch = workdir / path.name
    scratch.write_text(dump_yaml(data))
    return scratch


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?(e-?\d+)?(?![\w])")
_LISTING = re.compile(r"(accepts|use one of|available|one of):? [^;()]*")
_PARENTHESISED_LIST = re.compile(r"\([^()]*,[^()]*\)")


def cause(issue: Any) -> str:
    """The issue with values blanked: '<key>: <message>' where quoted names, numbers and listings are elided."""
    key = re.sub(r"\[\d+\]|\.\d+(?=\.|$)", "[*]", issue.key)
    key = re.sub(r"^validation_dataset_\w+", "validation_dataset_*", key)
    message = _PARENTHESISED_LIST.sub("(…)", _LISTING.sub(lambda m: f"{m.group(1)}: …", issue.message))
    message = _QUOTED.sub("'…'", message)
    message = _NUMBER.sub("N", message)
    return f"{key}: {message}" if key else message


def collect_targets(data: Any, top: bool = True) -> Iterator[str]:
    """Every ``_target_`` / ``*_fn`` name, and a top-level ``recipe:`` given as a bare name."""
    if top and isinstance(data, dict) and isinstance(data.get("recipe"), str):
        yield data["recipe"]
    if isinstance(data, dict):
        for key, value in data.items():
            if (key == "_target_" or str(key).endswith("_fn")) and isinstance(value, str):
                yield value
            yield from collect_targets(value, top=False)
    elif isinstance(data, list):
        for value in data:
            yield from collect_targets(value, top=False)


def target_status(resolver: Any, name: str) -> str:
    """Where a target name leads here: our implementation (through an alias), a library callable, or a refusal."""
    from automodel.config import TargetError

    expanded = resolver.expand(name)
    try:
        resolver.resolve(name)
    except TargetError as err:
        return f"refused: {str(err).split(';')[0].split(' (')[0].replace(repr(name), 'it')}"
    except Exception as err:  # an import that fails outside the resolver's checks (a missing optional backend)
        return f"crash {type(err).__name__}: {str(err).strip().splitlines()[0][:80]}"
    if expanded.split(".")[0].startswith("automodel"):
        return f"ours: {expanded}" if expanded != name else "ours"
    return "library"


def survey_file(path: Path, assets: dict[str, str], workdir: Path) -> tuple[list[str], list[str], list[str]]:
    """(report lines, causes, [best fit] causes) for one file."""
    from automodel.config import load_yaml_file
    from automodel.errors import ConfigError

    try:
        data = load_yaml_file(path)
    except ConfigError as err:
        return [f"  {issue}" for issue in err.issues], [cause(i) for i in err.issues], []
    printed, issues = validate(path, [])
    overrides = list(hub_overrides(data, assets))
    lines = []
    # refused for an unreachable id (or a token id of its tokenizer)
    if overrides and any(i.key.rsplit(".", 1)[-1] in (*HUB_KEYS, *STANDIN_TOKEN_IDS) for i in issues):
        lines = [f"  override {key} -> {value}" for key, value in overrides]
        printed, issues = validate(path, overrides)
    else:
        overrides = []
    if not issues:
        return [*lines, f"  PASS ({printed.split(': ', 1)[-1]})"], [], []
    lines += [f"  {issue}" for issue in issues]
    causes, fallback = [cause(i) for i in issues], []
    if recipe_unresolvable(issues):
        printed, more = validate(without_recipe(path, workdir), overrides)
        lines += [f"  [best fit] {issue}" for issue in more] or [f"  [best fit] valid ({printed})"]
        fallback = [cause(i) for i in more]
    return lines, causes, fallback


def domain_of(folder: str, path: Path | None = None) -> str:
    """The domain of an example in ``folder``; in a folder of mixed ones (convergence/), the one its recipe names."""
    known = {"vlm_finetune": "vlm", "vlm_kd": "vlm", "retrieval": "retrieval", "diffusion": "diffusion"}
    if folder in known or path is None:
        return known.get(folder, "llm")
    from automodel.config import load_yaml_file

    recipe = str(load_yaml_file(path).get("recipe", ""))
    return "vlm" if "VLM" in recipe else "llm"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=Path, help="upstream examples/ directory")
    parser.add_argument("--folders", nargs="*", default=list(FOLDERS), help="sub-folders to survey")
    args = parser.parse_args()
    from automodel.plugins.manager import get_plugin_manager

    resolver = get_plugin_manager().resolver()
    assets = local_assets()
    passed = total = 0
    causes: collections.Counter[str] = collections.Counter()
    fallback_causes: collections.Counter[str] = collections.Counter()
    per_folder: dict[str, list[int]] = {}
    targets: collections.Counter[str] = collections.Counter()
    examples = args.examples.resolve()
    # upstream runs its examples from its repository root, where their relative paths (chat templates) point
    with tempfile.TemporaryDirectory() as workdir, contextlib.chdir(examples.parent):
        for folder in args.folders:
            files = sorted(p for p in (examples / folder).rglob("*") if p.suffix in (".yaml", ".yml"))
            per_folder[folder] = [0, len(files)]
            for path in files:
                total += 1
                lines, found, fallback = survey_file(path, assets[domain_of(folder, path)], Path(workdir))
                print(path.relative_to(examples))
                print("\n".join(lines), flush=True)
                if not found:
                    passed += 1
                    per_folder[folder][0] += 1
                causes.update(set(found))
                fallback_causes.update(set(fallback))
                with contextlib.suppress(Exception):
                    from automodel.config import load_yaml_file

                    targets.update(collect_targets(load_yaml_file(path)))
    print(f"\n=== summary: {passed} of {total} pass ===")
    for folder, (ok, count) in per_folder.items():
        print(f"  {folder:<14} {ok:>4} / {count}")
    print("\n=== refusals by cause (files refused for it) ===")
    for text, count in causes.most_common():
        print(f"{count:>5}  {text}")
    print("\n=== behind an unresolvable recipe: refusals against the best-fit route (files) ===")
    for text, count in fallback_causes.most_common():
        print(f"{count:>5}  {text}")
    print("\n=== _target_ / *_fn names used (count, name, where it leads here) ===")
    for name, count in targets.most_common():
        print(f"{count:>5}  {name}  [{target_status(resolver, name)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
