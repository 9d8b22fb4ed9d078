"""Hugging Face helpers the domains share: where a model section loads from, tokenizers and the vocabulary check,
LoRA through peft (config, apply, adapter files) and greedy-generation evaluation.

torch, transformers and peft are imported on first use, so importing this module stays light.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel.config.model_paths import missing_location
from automodel.data import load_rows
from automodel.errors import AutomodelError
from automodel.lora_targets import (
    all_linear_names,
    fused_expert_weights,
    glob_targets,
    named_refused,
    peft_patterns,
    peft_refused,
    refused_summary,
)

if TYPE_CHECKING:
    import torch

__all__ = ["ADAPTER_WEIGHTS", "EvalGenerationConfig", "PeftConfig", "align_special_tokens", "apply_lora",
           "check_vocab", "exact_match", "is_adapter_dir", "load_adapter_weights", "load_rows", "load_tokenizer",
           "lora_config", "model_source", "record_adapter_base", "record_run_base", "recorded_adapter_base"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
SOURCE_KEYS = ("pretrained_model_name_or_path", "name_or_path", "config")


# ---- where a model loads from, tokenizers ------------------------------------------------------------------------

def model_source(model: Mapping[str, Any] | None, keys: tuple[str, ...] = SOURCE_KEYS) -> tuple[str, str] | None:
    """``(value, "model.<key>")`` of the first of ``keys`` that the model section sets to a string: the directory,
    file or hub name the model loads from (its tokenizer or processor usually lives there too)."""
    if model is None:
        return None
    for key in keys:
        value = model.get(key)
        if isinstance(value, str):
            return value, f"model.{key}"
    return None


def load_tokenizer(name_or_path: str, key: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained`` (with ``kwargs``, such as the model's ``gguf_file``) with errors naming
    ``key``; the pad token falls back to EOS."""
    from transformers import AutoTokenizer

    if missing_location(str(name_or_path)):
        raise AutomodelError(f"{key}: '{name_or_path}' does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError/ValueError/... for a bad path
        raise AutomodelError(f"{key}: cannot load a tokenizer from '{name_or_path}': {err}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_vocab(tokenizer: Any, model_config: Any, message: str) -> None:
    """A tokenizer with more tokens than the model's embedding table would index out of range: refuse it with
    ``message`` (formatted with ``tokens`` and ``vocab``)."""
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise AutomodelError(message.format(tokens=len(tokenizer), vocab=vocab))


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def align_special_tokens(model: Any, tokenizer: Any) -> list[str]:
    """Give the model's config and generation config the tokenizer's bos / eos / pad ids where they differ.

    What the model was trained with is the tokenizer's tokens; a saved ``config.json`` / ``generation_config.json``
    with other ids makes a plain ``model.generate()`` run past the tokenizer's EOS. An eos list that holds the
    tokenizer's EOS (Llama 3: end of text and end of turn) is kept. Returns one line per change, for the log.
    """
    changes = []
    holders = [(name, getattr(model, name, None)) for name in ("config", "generation_config")]
    for name in SPECIAL_TOKENS:
        wanted = getattr(tokenizer, name, None)
        for where, holder in holders:
            current = getattr(holder, name, None) if holder is not None else None
            if holder is None or wanted is None or current == wanted or \
                    (isinstance(current, (list, tuple)) and wanted in current):
                continue
            setattr(holder, name, wanted)
            changes.append(f"{where}.{name} {current} -> {wanted}")
    return changes


# ---- LoRA -------------------------------------------------------------------------------------------------------

class PeftConfig:
    """LoRA settings with upstream-compatible names (``dim``/``alpha``/``match_all_linear``) or peft's own.

    ``target_modules`` are module-name patterns (``q_proj``, ``*.v_proj``); with none given, or
    ``match_all_linear: true``, every linear layer except the output head gets an adapter. Upstream's
    ``dropout_position`` and ``lora_A_init`` are checked (:meth:`automodel_config_issues`: peft's layers are ``pre`` and
    ``uniform``); ``use_triton: true`` is named inert in a run-start note (``training/stages/peft.py``).
    """

    def __init__(self, target_modules: list[str] | str | None = None, match_all_linear: bool = False,
                 exclude_modules: list[str] | None = None, dim: int | None = None, r: int | None = None,
                 rank: int | None = None, alpha: float | None = None, lora_alpha: float | None = None,
                 dropout: float | None = None, lora_dropout: float | None = None, use_triton: bool = False,
                 use_dora: bool = False, dropout_position: str = "pre", lora_A_init: str | None = None,
                 use_memory_efficient_lora: bool = False, moe_rank_scaling: bool = False,
                 lora_dtype: str | None = None):
        """``lora_dtype`` (upstream's): float32 only, what peft keeps the adapters in (checked by
        :meth:`automodel_config_issues`)."""
        given = [v for v in (dim, r, rank) if v is not None]
        if len(set(given)) > 1:
            raise ValueError(f"peft: dim/r/rank disagree ({given}); give one")
        self.rank = given[0] if given else 8
        self.alpha = alpha if alpha is not None else (lora_alpha if lora_alpha is not None else 2 * self.rank)
        self.dropout = dropout if dropout is not None else (lora_dropout or 0.0)
        self.target_modules = target_modules
        self.match_all_linear = match_all_linear or not target_modules
        self.exclude_modules = exclude_modules
        self.use_dora = use_dora
        self.memory_efficient = use_memory_efficient_lora
        self.moe_rank_scaling = moe_rank_scaling
        self.skipped: list[str] = []  # what to_lora_config left out of a glob / all-linear (peft cannot wrap it)
        if self.rank < 1:
            raise ValueError(f"peft.dim must be >= 1, found {self.rank}")

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        """Upstream's LoRA switches that act in its own LoRA modules, which this build does not have: peft's layers
        apply the dropout to the adapter's input (upstream's ``dropout_position: pre``) and initialise ``lora_A``
        kaiming-uniform (upstream's ``lora_A_init`` other than ``xavier``)."""
        issues = {}
        position = kwargs.get("dropout_position", "pre")
        dropout = kwargs.get("dropout") or kwargs.get("lora_dropout") or 0.0
        if position not in ("pre", "post"):
            issues["dropout_position"] = f"{position!r}: expected pre or post"
        elif position == "post" and dropout:
            issues["dropout_position"] = (f"post (dropout on the adapter's output) with dropout {dropout}: peft's LoRA "
                                          "layers drop the adapter's input (pre); set dropout_position: pre, or "
                                          "dropout: 0.0")
        init = kwargs.get("lora_A_init")
        if init == "xavier":
            issues["lora_A_init"] = ("xavier: peft initialises lora_A kaiming-uniform (upstream's 'uniform'); set "
                                     "lora_A_init: uniform or remove it")
        elif init not in (None, "uniform", "kaiming"):
            issues["lora_A_init"] = f"{init!r}: expected uniform (kaiming-uniform, peft's initialisation)"
        dtype = kwargs.get("lora_dtype")
        if dtype is not None and str(dtype).removeprefix("torch.") not in ("float32", "fp32", "float"):
            issues["lora_dtype"] = (f"{dtype}: peft keeps the adapter weights in float32 (it upcasts them from a bf16 "
                                    "/ fp16 base, for stable updates) and they compute in the run's precision "
                                    "(distributed.mp_policy); remove it or give float32")
        if kwargs.get("use_memory_efficient_lora") and kwargs.get("use_dora"):
            issues["use_memory_efficient_lora"] = ("true recomputes plain LoRA's rank-r activation; DoRA "
                                                   "(use_dora: true) has no such path: set one of them false")
        targets = kwargs.get("target_modules")
        globs = any("*" in str(t) for t in ([targets] if isinstance(targets, str) else targets or []))
        if kwargs.get("moe_rank_scaling") and targets and not globs and not kwargs.get("match_all_linear"):
            issues["moe_rank_scaling"] = ("true scales the LoRA rank of the MoE experts, which only LoRA on all "
                                          "linear layers or a glob (such as '*') adapts here (target_modules names "
                                          "modules, and the experts are fused parameters): remove target_modules or "
                                          "moe_rank_scaling")
        return issues

    def to_lora_config(self, model: torch.nn.Module | None = None) -> Any:
        """peft's config; ``model`` (the model to adapt) is needed for ``moe_rank_scaling``."""
        import peft

        parameters: list[str] = []
        self.skipped = []
        if self.match_all_linear:
            targets: Any = "all-linear"
            if model is not None:
                linear = all_linear_names(model)
                self.skipped = peft_refused(model, linear)
                targets = [name for name in linear if name not in self.skipped] if self.skipped else targets
        else:
            targets = peft_patterns(self.target_modules)
            if isinstance(targets, str) and model is not None:
                targets, parameters, self.skipped = glob_targets(model, targets, self.target_modules)
            elif model is not None:
                named_refused(model, targets)
        excluded = peft_patterns(self.exclude_modules) if self.exclude_modules else None
        if self.use_dora and (parameters or (self.match_all_linear and fused_expert_weights(model))):
            reach = "all linear layers (peft adapts the experts with them)" if self.match_all_linear else \
                f"target_modules {self.target_modules}"
            raise AutomodelError(f"peft.use_dora: true: peft's DoRA cannot adapt a mixture-of-experts model's fused "
                                 f"experts (3-D gate_up_proj / down_proj), which {reach} reach; name the linear "
                                 "layers to adapt in peft.target_modules (such as [q_proj, v_proj]) or set "
                                 "use_dora: false")
        if self.moe_rank_scaling and not self.match_all_linear and not parameters:
            raise AutomodelError(f"peft.moe_rank_scaling: true scales the LoRA rank of the MoE experts, and "
                                 f"target_modules {self.target_modules} reach none; remove it or target the experts")
        ranks, alphas = self._moe_patterns(model) if self.moe_rank_scaling else ({}, {})
        return peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                               target_modules=targets, exclude_modules=excluded, rank_pattern=ranks,
                               alpha_pattern=alphas, use_dora=self.use_dora, task_type=lora_task_type(model),
                               target_parameters=parameters or None)

    def _moe_patterns(self, model: torch.nn.Module | None) -> tuple[dict[str, int], dict[str, float]]:
        """Upstream's ``moe_rank_scaling``: the experts' LoRA rank is ``dim // experts per token`` and their alpha
        ``alpha`` (as upstream: peft would double both for the fused gate_up_proj), so the experts a token visits
        add together about the rank of one dense projection. The keys of peft's ``rank_pattern`` / ``alpha_pattern``
        for them: each fused experts parameter (3-D ``gate_up_proj`` / ``down_proj``) by its full name, as
        ``(?:name)`` so that in the ``adapter_config.json`` peft writes with sorted keys they still come before
        peft's own ``.*\\.gate_up_proj`` (peft takes the first pattern that matches)."""
        if model is None:
            raise AutomodelError("peft.moe_rank_scaling: true scales the rank of LoRA on a causal LM's MoE experts, "
                                 "which this LoRA (on named language-model layers) does not adapt; remove it")
        config = getattr(model, "config", None)
        per_token = getattr(config.get_text_config(), "num_experts_per_tok", None) if config is not None else None
        names = fused_expert_weights(model)
        if not names or not isinstance(per_token, int):
            raise AutomodelError("peft.moe_rank_scaling: true scales the LoRA rank of a mixture-of-experts model's "
                                 "experts, and this model has no fused experts (3-D gate_up_proj / down_proj) with "
                                 "num_experts_per_tok in its config; remove it")
        if self.rank < per_token:
            raise AutomodelError(f"peft.moe_rank_scaling: true gives the experts rank dim {self.rank} // "
                                 f"{per_token} experts per token = 0; set peft.dim to at least {per_token} or "
                                 "remove moe_rank_scaling")
        keys = [f"(?:{re.escape(name)})" for name in names]
        return {key: self.rank // per_token for key in keys}, {key: self.alpha for key in keys}


def is_sequence_classifier(class_name: str) -> bool:
    """Whether a model class (or a config's ``architectures`` entry) is a transformers sequence classifier."""
    return class_name.endswith("ForSequenceClassification")


def lora_task_type(model: torch.nn.Module | None) -> str | None:
    """peft's task for LoRA on ``model``: ``SEQ_CLS`` for a sequence classifier, whose head peft then trains whole
    (``modules_to_save``: a new head is random and must learn) and saves with the adapter; None (peft's
    task-agnostic ``PeftModel``, its forward passed through) for a model that says it does not generate
    (``generates = False``: a speculative-decoding draft); else ``CAUSAL_LM``."""
    if is_sequence_classifier(type(model).__name__):
        return "SEQ_CLS"
    return "CAUSAL_LM" if getattr(model, "generates", True) else None


def lora_config(built: Any, model: torch.nn.Module | None = None) -> Any:
    """The ``peft.LoraConfig`` of what the ``peft:`` section built (our PeftConfig, or a peft config as given) for
    ``model``."""
    import peft

    if isinstance(built, PeftConfig):
        return built.to_lora_config(model)
    if isinstance(built, peft.PeftConfig):
        return built
    raise AutomodelError(f"peft._target_: built {type(built).__name__}; expected automodel.hf.PeftConfig (also "
                         "automodel_llm.peft.PeftConfig) or peft.LoraConfig")


def apply_lora(model: torch.nn.Module, config: Any, where: str = "", memory_efficient: bool = False,
               plain: bool = False) -> tuple[torch.nn.Module, str]:
    """``model`` wrapped with LoRA adapters (only they train) and a line saying how many parameters train;
    ``memory_efficient``: each adapter's rank-r activation is recomputed in backward (``lora_memory``). ``plain``:
    peft's task-agnostic ``PeftModel``, whose forward passes its arguments through as given (a pipeline stage's
    ``forward(inputs, ...)``), whatever ``config.task_type`` says; the adapter's names and files are the same."""
    import peft

    try:
        wrapped = peft.PeftModel(model, config) if plain else peft.get_peft_model(model, config)
    except ValueError as err:
        raise AutomodelError(f"peft.target_modules: {err}") from None
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    kind = "DoRA" if getattr(config, "use_dora", False) else "LoRA"
    line = f"{kind} r={config.r} alpha={config.lora_alpha}{where}: {trainable} of {total} parameters train"
    if memory_efficient:
        from automodel.lora_memory import recompute_lora_branches

        line += f"; {recompute_lora_branches(wrapped)} adapters recompute their rank-r activation in backward"
    return wrapped, line


def skipped_note(built: Any) -> str:
    """The note on the modules a glob or ``all-linear`` reached and peft cannot wrap (empty when none)."""
    skipped = getattr(built, "skipped", None) if isinstance(built, PeftConfig) else None
    if not skipped:
        return ""
    return (f"; note: peft.target_modules leaves out {refused_summary(skipped)}, which peft cannot wrap with LoRA "
            "on this model type (the Mamba mixer's fused scan reads out_proj's weight directly)")


def memory_efficient(built: Any) -> bool:
    """Whether the ``peft:`` section asked for upstream's ``use_memory_efficient_lora``."""
    return isinstance(built, PeftConfig) and built.memory_efficient


def is_adapter_tensor(name: str) -> bool:
    """Whether the model tensor ``name`` belongs to the peft adapter, which peft saves in its file: its LoRA / DoRA
    weights and the modules it trains whole beside them (``modules_to_save``, a classifier's head)."""
    return ".lora_" in name or ".modules_to_save." in name


def is_adapter_dir(directory: Path) -> bool:
    return (directory / ADAPTER_WEIGHTS).is_file()


def load_adapter_weights(model: torch.nn.Module, directory: Path) -> None:
    """Adapter weights of a saved LoRA ``model/`` directory into a model that has the same adapters."""
    import peft
    from safetensors.torch import load_file

    if not hasattr(model, "peft_config"):
        raise AutomodelError(f"restore_from.path: '{directory}' holds a LoRA adapter but this config has no peft: "
                             "section; add the same peft: settings as the run that wrote it")
    result = peft.set_peft_model_state_dict(model, load_file(str(directory / ADAPTER_WEIGHTS)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise AutomodelError(f"restore_from.path: adapter in '{directory}' does not match the model: unexpected "
                             f"keys {unexpected[:5]}")


def record_adapter_base(directory: Path, source: str) -> None:
    """Record in ``adapter_config.json`` (``base_model_name_or_path``) the base model the adapter was trained on,
    as the run resolved it (``${VAR}`` substituted; a local path made absolute): what ``automodel export`` merges
    into, whatever the environment says later. For a freshly initialised base it is the config it was built from."""
    path = Path(source).expanduser()
    file = directory / ADAPTER_CONFIG
    data = json.loads(file.read_text(encoding="utf-8"))
    data["base_model_name_or_path"] = str(path.resolve()) if path.exists() else source
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def record_run_base(directory: Path, model: Mapping[str, Any] | None) -> None:
    """Where ``directory`` holds a LoRA adapter, record the base ``model`` loaded (:func:`record_adapter_base`)."""
    found = model_source(model)
    if (directory / ADAPTER_CONFIG).is_file() and found is not None:
        record_adapter_base(directory, found[0])


def recorded_adapter_base(directory: Path) -> str | None:
    """The base recorded in a saved adapter's ``adapter_config.json`` (None when it names none)."""
    file = directory / ADAPTER_CONFIG
    value = json.loads(file.read_text(encoding="utf-8")).get("base_model_name_or_path") if file.is_file() else None
    return value if isinstance(value, str) and value else None


# ---- greedy-generation evaluation -------------------------------------------------------------------------------

@dataclass
class EvalGenerationConfig:
    enabled: bool = field(default=True, metadata={"help": "answer validation questions greedily after training"})
    num_examples: int | None = field(default=None, metadata={"help": "how many validation questions (None: all)"})
    num_shown: int = field(default=3, metadata={"help": "how many answers to print"})
    max_new_tokens: int = field(default=8, metadata={"help": "generation length limit"})


def greedy_answer(model: Any, tokenizer: Any, prompt: str | list[int], max_new_tokens: int, device: torch.device,
                  synced: bool = False, do_sample: bool = False, skip_special_tokens: bool = True) -> str:
    """The model's greedy continuation of ``prompt`` (text, or its token ids). ``synced``: every rank generates
    together (the weights are sharded, so each forward is a collective): ranks that finish early keep joining the
    others' forwards. ``do_sample``: sample with the model's generation config instead. ``skip_special_tokens``
    false keeps tokens such as Llama's ``<|python_tag|>`` in the text (tool calls are read from them)."""
    import torch

    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        rendered = bool(bos) and prompt.startswith(bos)  # a chat template's render already holds the BOS token
        prompt = tokenizer(prompt, add_special_tokens=not rendered)["input_ids"]
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=do_sample, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, synced_gpus=synced)
    # a model configured to return more (upstream's output_hidden_states: true) gets a GenerateOutput back
    sequences = getattr(out, "sequences", out)
    return tokenizer.decode(sequences[0, ids.shape[1]:], skip_special_tokens=skip_special_tokens).strip()


def exact_match(model: Any, tokenizer: Any, pairs: list[tuple[str, str]], max_new_tokens: int,
                device: torch.device, synced: bool = False) -> tuple[float, list[tuple[str, str, str]]]:
    """Accuracy over (prompt, answer) pairs and the (prompt, expected, generated) triples (``synced``: see
    :func:`greedy_answer`; every rank then calls this with the same pairs)."""
    was_training = model.training
    model.eval()
    try:
        results = [(prompt, answer, greedy_answer(model, tokenizer, prompt, max_new_tokens, device, synced))
                   for prompt, answer in pairs]
    finally:
        model.train(was_training)
    correct = sum(1 for _, expected, got in results if got.strip() == expected.strip())
    return correct / max(len(results), 1), results
