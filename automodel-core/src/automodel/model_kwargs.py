"""Upstream's NeMoAutoModel keyword arguments in a model section: what each does here.

Upstream's model factories take keys that transformers' ``from_pretrained`` does not (it would pass them to the
model's ``__init__``: a TypeError at run time). Each one here either acts or is refused at validation with the
reason (:func:`upstream_model_issues`, no torch import); the factories take them out before transformers sees them
(:func:`take_upstream_kwargs`) and refuse the same values when called directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from automodel.config_reads import config_mapping_issues
from automodel.errors import AutomodelError
from automodel.model_backend import (
    GATE_DTYPES,
    apply_backend,
    apply_to_model,
    attention_issue,
    attention_split,
    has_cuda,
    model_backend_issues,
    use_language_model_attention,
)

LIGER_KERNEL_REFUSAL = ("true is not supported: Liger's Triton kernels need a CUDA GPU and the liger-kernel package, "
                        "which this machine lacks; set false")
# sdpa_method's names -> torch.nn.attention.SDPBackend members; flash_attention and math also run on a CPU
SDPA_BACKENDS = {"flash_attention": "FLASH_ATTENTION", "efficient_attention": "EFFICIENT_ATTENTION",
                 "math": "MATH", "cudnn_attention": "CUDNN_ATTENTION"}
CPU_SDPA_BACKENDS = ("flash_attention", "math")
SWITCHES = ("use_liger_kernel", "force_hf", "use_sdpa_patching", "mtp_use_repeated_layer")  # true or false
UPSTREAM_KEYS = ("use_liger_kernel", "force_hf", "use_sdpa_patching", "sdpa_method")  # the MTP keys: automodel.mtp
SDPA_METHOD_PARALLEL_REFUSAL = ("runs the model's whole forward under those SDPA backends, but a pipeline stage runs "
                                "its part of the model without that forward and context parallelism chooses its own "
                                "backends; remove it (use_sdpa_patching: true alone lets torch choose) or use "
                                "distributed.pp_size and cp_size 1")
# model_type -> (the module of its MTP heads, the main model's final norm the heads start from, the text config's key
# counting the checkpoint's depths): automodel.mtp
MTP_FAMILIES = {"nemotron_h": ("automodel.mtp.nemotron_h", "model.norm_f", "num_nextn_predict_layers"),
                "qwen3_5": ("automodel.mtp.qwen3_5", "model.language_model.norm", "mtp_num_hidden_layers"),
                "qwen3_5_moe": ("automodel.mtp.qwen3_5", "model.language_model.norm", "mtp_num_hidden_layers")}
MTP_TEXT_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text")  # the text configs of those whose depths count lives there
MTP_DEPTH_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")  # upstream's name first, then Qwen3.5's
MTP_KEYS = ("num_nextn_predict_layers", "mtp_loss_scaling_factor", "mtp_use_repeated_layer")  # what asks for heads
# where a depths count is a config mapping's, which asks only of a family with heads (mtp_depths_in_config)
MTP_CONFIG_MAPPINGS = ("model.config.", "model.text_config.")
MTP = f"upstream's multi-token-prediction heads (implemented here for {', '.join(MTP_FAMILIES)})"


def mtp_config_depths(text_config: Any, key: str) -> int:
    """The MTP depths a model's text config holds: upstream's ``num_nextn_predict_layers`` where set (it wins, as in
    upstream), else the family's ``key``."""
    upstream = getattr(text_config, "num_nextn_predict_layers", None)
    return int(upstream if upstream is not None else getattr(text_config, key, 0) or 0)


def mtp_depths_in_config(model: Mapping[str, Any]) -> str | None:
    """The key (``config.num_nextn_predict_layers``, ``config.text_config.mtp_num_hidden_layers`` ...) where the
    model section's own ``config`` / ``text_config`` mapping sets a depths count > 0: upstream's form, where the
    config's count turns on the heads of a family that has them (:data:`MTP_FAMILIES`; another family's count
    builds none, as transformers' and upstream's code for it, and the run says so); None where none does (a
    checkpoint's own config.json is not the user's ask)."""
    for name in ("config", "text_config"):
        nested = model.get(name)
        inner = nested.get("text_config") if isinstance(nested, Mapping) else None
        for path, mapping in ((name, nested), (f"{name}.text_config", inner)):
            for key in MTP_DEPTH_KEYS if isinstance(mapping, Mapping) else ():
                value = mapping.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return f"{path}.{key}"
    return None


def mtp_depths_zero(model: Mapping[str, Any]) -> bool:
    """Whether a model section (or a factory's keyword arguments) turns the heads off: ``num_nextn_predict_layers: 0``
    at its top, or a depths key 0 in the config it builds from (``config`` or ``text_config``, a mapping or a built
    config: upstream's DeepSeek-V4 and Step 3 forms); a scaling factor then weighs no heads."""
    if model.get("num_nextn_predict_layers") == 0:
        return True
    for name in ("config", "text_config"):
        nested = model.get(name)
        values = [nested.get(key) if isinstance(nested, Mapping) else getattr(nested, key, None)
                  for key in MTP_DEPTH_KEYS] if nested is not None else []
        if 0 in values and not any(values):
            return True
    return False


def dtype_name(value: Any) -> str | None:
    """``bf16`` / ``BFloat16`` / ``torch.bfloat16`` -> ``bfloat16`` (upstream's names, any case); None otherwise."""
    if not isinstance(value, str):
        return None
    return GATE_DTYPES.get(value.strip().lower().removeprefix("torch."))


def dtype_issue(value: Any) -> str | None:
    """Why a model dtype name cannot be used (None: it can; a torch dtype object is checked when built)."""
    if value is None or value == "auto" or not isinstance(value, str) or dtype_name(value) is not None:
        return None
    return f"'{value}' is not a floating dtype; use auto or one of {', '.join(GATE_DTYPES)} (torch.bfloat16 too)"


def _sdpa_method_issue(kwargs: Mapping[str, Any]) -> str | None:
    names = kwargs.get("sdpa_method")
    if names is None:
        return None
    if not kwargs.get("use_sdpa_patching"):
        return "acts only with use_sdpa_patching: true (upstream ignores it otherwise); remove it or set that"
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names:
        return f"expected a list of {', '.join(SDPA_BACKENDS)}, found {names!r}"
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if unknown:
        return f"{unknown[0]!r} is not an SDPA backend; use {', '.join(SDPA_BACKENDS)}"
    if not has_cuda() and not set(names) & set(CPU_SDPA_BACKENDS):
        return (f"{', '.join(names)} run only on CUDA (not on this machine): add math or flash_attention, "
                "which also run on a CPU")
    return None


def upstream_model_issues(kwargs: Mapping[str, Any], mtp: bool = False) -> dict[str, str]:
    """Validation's check of upstream's model keys (see the module docstring), each with why; ``mtp``: whether the
    factory's recipe trains MTP heads (the LLM one), else the keys asking for them are refused."""
    issues = {key: f"expected true or false, found {kwargs[key]!r}" for key in SWITCHES
              if kwargs.get(key) is not None and not isinstance(kwargs[key], bool)}
    for key in ("dtype", "torch_dtype"):
        if (issue := dtype_issue(kwargs.get(key))) is not None:
            issues[key] = issue
    if (issue := attention_issue(kwargs.get("attn_implementation"))) is not None:
        issues["attn_implementation"] = issue
    issues.update(_config_attention_issues(kwargs.get("config")))
    text_config = kwargs.get("text_config")
    if isinstance(text_config, Mapping) and "cp_full_attn_backend" in text_config:
        issues["text_config.cp_full_attn_backend"] = (
            f"{text_config['cp_full_attn_backend']!r} picks the kernel of the full-attention chunks under context "
            "parallelism in upstream's own Gemma 4 model (flex: FlexAttention; ffpa: FFPA's CUDA kernels, which "
            "this machine lacks); transformers' model here runs context parallelism through its all-gather SDPA "
            "attention (docs/distributed.md): remove it")
    if kwargs.get("use_liger_kernel") is True:
        issues["use_liger_kernel"] = LIGER_KERNEL_REFUSAL
    if kwargs.get("force_hf") is False:
        issues["force_hf"] = ("false asks for upstream's own model implementation, which automodel does not include "
                              "(it builds transformers' implementation, as force_hf: true does); set true or remove it")
    if kwargs.get("use_sdpa_patching") and kwargs.get("attn_implementation") == "eager":
        issues["use_sdpa_patching"] = "true runs attention through torch's SDPA, but attn_implementation is 'eager'"
    if (issue := _sdpa_method_issue(kwargs)) is not None:
        issues["sdpa_method"] = issue
    issues.update(_mtp_issues(kwargs, mtp))
    return issues


# keys of a model config that pick its attention: transformers' own, and the one Nemotron-Flash's code reads
CONFIG_ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "attn_implementation_new")


def _config_attention_issues(config: Any) -> dict[str, str]:
    """A ``config`` node (upstream's ``AutoConfig.from_pretrained`` with keys that override the checkpoint's)
    asking for an attention that needs CUDA kernels: the model's build would fail on it."""
    if not isinstance(config, Mapping):
        return {}
    issues = {}
    for key in CONFIG_ATTENTION_KEYS:
        value = config.get(key)
        issue = attention_issue(value)
        if issue is not None and "needs" in issue:  # other names may be a checkpoint's own (remote code) choice
            issues[f"config.{key}"] = issue
    return issues


def _mtp_issues(kwargs: Mapping[str, Any], trained: bool) -> dict[str, str]:
    depths, factor = kwargs.get("num_nextn_predict_layers"), kwargs.get("mtp_loss_scaling_factor")
    if depths is not None and (isinstance(depths, bool) or not isinstance(depths, int) or depths < 0):
        return {"num_nextn_predict_layers": f"expected the number of {MTP} (an integer >= 0), found {depths!r}"}
    issues = {}
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 0):
        issues["mtp_loss_scaling_factor"] = f"expected a number >= 0 (the weight of the heads' loss), found {factor!r}"
    asked = [key for key in MTP_KEYS if kwargs.get(key) not in (None, False, 0)]
    if asked and not mtp_depths_zero(kwargs) and not trained and not issues:
        issues[asked[0]] = (f"asks for {MTP}, which the LLM and VLM fine-tuning recipes train (automodel_llm's "
                            "AutoModelForCausalLM, automodel_vlm's AutoModelForImageTextToText), not this model "
                            "section's; remove the MTP keys")
    return issues


def model_issues(kwargs: Mapping[str, Any], mtp: bool = False, composite: bool = False) -> dict[str, str]:
    """A model factory's validation check: upstream's keys and its ``backend`` (``mtp``: see
    :func:`upstream_model_issues`; ``composite``: :func:`automodel.model_backend.model_backend_issues`)."""
    return {**upstream_model_issues(kwargs, mtp), **model_backend_issues(kwargs, composite)}


def mtp_model_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """:func:`model_issues` of the LLM factories, whose recipes train MTP heads."""
    return model_issues(kwargs, mtp=True)


def composite_model_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """:func:`model_issues` of the VLM factories: their recipes train MTP heads, and their models are composite (a
    language model beside vision or audio towers), where ``backend.attn`` and ``attn_implementation`` may differ
    (:func:`automodel.model_backend.attention_split`)."""
    return model_issues(kwargs, mtp=True, composite=True)


def take_upstream_kwargs(kwargs: dict[str, Any], mtp: bool = False) -> list[str] | None:
    """Take upstream's keys out of a factory's keyword arguments (refusing what validation refuses); the SDPA
    backends the model's forward must run under (None: torch's own choice)."""
    issues = upstream_model_issues(kwargs, mtp)
    if issues:
        raise AutomodelError("; ".join(f"model.{key}: {message}" for key, message in issues.items()))
    taken = {key: kwargs.pop(key) for key in UPSTREAM_KEYS if key in kwargs}
    return list(taken["sdpa_method"]) if taken.get("sdpa_method") else None


def take_model_settings(kwargs: dict[str, Any], checkpoint: str | None = None, mtp: bool = False,
                        built_from: Mapping[str, Any] | None = None) -> Callable[[Any], Any]:
    """Take upstream's keys and ``backend`` out of a model factory's keyword arguments (what transformers must not
    see; the attention ``backend`` selects stays in them); returns what finishes the built model: the backend's
    routing and router precision (:func:`automodel.model_backend.apply_to_model`), the MTP heads the keys ask for
    (:mod:`automodel.mtp`, initialised from ``checkpoint``'s ``mtp.*`` tensors where it has them; ``mtp``: the
    factory's recipe trains them, else they are refused; ``built_from``: the ``config`` / ``text_config`` a factory
    takes as parameters, whose MTP depths may turn the heads off), then the SDPA backends."""
    sdpa_backends = take_upstream_kwargs(kwargs, mtp)
    from automodel.mtp.attach import attach_heads, read_settings

    heads = read_settings({**kwargs, **(built_from or {})}, kwargs, config_asks=mtp)
    split = attention_split(kwargs)
    backend = apply_backend(kwargs)

    def finish(model: Any) -> Any:
        model = apply_to_model(model, backend)
        if split is not None:
            use_language_model_attention(model, split[0])
        if heads is not None:
            attach_heads(model, heads, checkpoint)
        return run_under_sdpa_backends(model, sdpa_backends)

    return finish


def run_under_sdpa_backends(model: Any, names: list[str] | None) -> Any:
    """Upstream's SDPA patching: the model's forward (and so its attention) runs under
    ``torch.nn.attention.sdpa_kernel`` of those backends, torch choosing among them."""
    if not names:
        return model
    import functools

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [getattr(SDPBackend, SDPA_BACKENDS[name]) for name in names]
    forward = model.forward

    @functools.wraps(forward)
    def under_backends(*args: Any, **kwargs: Any) -> Any:
        with sdpa_kernel(backends):
            return forward(*args, **kwargs)

    model.forward = under_backends
    return model


def apply_config_overrides(config: Any, overrides: Mapping[str, Any]) -> None:
    """Set a model section's config keys on a loaded transformers config: a mapping for a sub-config
    (``text_config: {use_cache: false}``) sets its attributes (``text_config`` on a plain config: the config's own);
    ``num_nextn_predict_layers: 0`` where the config has no such attribute is no heads, as without it. Any other key
    the config lacks is refused, naming it."""
    from transformers import PretrainedConfig

    for name, value in overrides.items():
        sub = config.get_text_config() if name == "text_config" else getattr(config, name, None)
        if isinstance(value, Mapping) and isinstance(sub, PretrainedConfig):
            for key, item in value.items():
                _set(sub, key, item, f"model.{name}.{key}")
        elif not (name == "num_nextn_predict_layers" and value == 0 and not hasattr(config, name)):
            _set(config, name, value, f"model.{name}")


def fresh_model_issues(from_config: Callable[..., Any]) -> Callable[[Mapping[str, Any]], dict[str, str]]:
    """The validation check of a factory's ``from_config`` (set as its ``automodel_config_issues``): a key that is
    neither one of its arguments nor an attribute of the config ``model.config`` gives (a mapping, a config.json or a
    local directory; a hub name is checked when the model is built), as :func:`check_config_keys` refuses it; and a
    key of a ``model.config`` mapping that nothing reads (:mod:`automodel.config_reads`)."""
    import inspect

    from automodel.model_files import HUB_ARGUMENTS, MODEL_KWARGS

    arguments = {*inspect.signature(from_config).parameters, "config", "text_config", "vision_config", "backend",
                 *UPSTREAM_KEYS, *MTP_KEYS, *HUB_ARGUMENTS, *MODEL_KWARGS}

    def issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        extra = {name: value for name, value in kwargs.items() if name not in arguments}
        config = _local_config(kwargs.get("config")) if extra else None
        found = config_mapping_issues(_without_mtp_depths(kwargs.get("config")))
        return found if config is None else {**found, **fresh_key_issues(config, extra)}

    return issues


def _without_mtp_depths(node: Any) -> Any:
    """A ``model.config`` mapping without its MTP depths keys (its own and its ``text_config``'s): the MTP checks
    read them (:func:`mtp_depths_zero`, :func:`mtp_config_depths`), where transformers' code may not."""
    if not isinstance(node, Mapping):
        return node
    kept = {k: v for k, v in node.items() if k not in MTP_DEPTH_KEYS}
    if isinstance(kept.get("text_config"), Mapping):
        kept["text_config"] = {k: v for k, v in kept["text_config"].items() if k not in MTP_DEPTH_KEYS}
    return kept


def _local_config(config: Any) -> Any:
    """The transformers config of ``model.config`` when it is here (a mapping with model_type, a config.json, a
    directory holding one), else None."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    try:
        if isinstance(config, str) and Path(config).is_file():
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        if isinstance(config, Mapping) and isinstance(config.get("model_type"), str):
            return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
        if isinstance(config, str) and (Path(config) / "config.json").is_file():
            return AutoConfig.from_pretrained(config)
    except (ValueError, KeyError, TypeError, OSError):
        return None  # refused with its own reason when built
    return None


def fresh_key_issues(config: Any, overrides: Mapping[str, Any]) -> dict[str, str]:
    """``{key: message}`` for each key of a ``from_config`` model section that the config built from
    ``model.config`` (``config``) does not have: transformers would keep it as an attribute nothing reads. The
    checkpoint key ``pretrained_model_name_or_path`` says which factory loads it instead."""
    found = {}
    for name, value in overrides.items():
        if name == "pretrained_model_name_or_path":
            found[name] = ("this model section builds a fresh model from model.config (from_config), which loads no "
                           "checkpoint; to train the checkpoint, end model._target_ with from_pretrained instead of "
                           "from_config and remove model.config")
        elif not (name == "num_nextn_predict_layers" and value == 0) and (issue := _key_issue(
                config, name, value, "an argument of from_config nor an attribute")):
            found[name] = issue
    return found


def check_config_keys(config: Any, overrides: Mapping[str, Any]) -> None:
    """Raise :func:`fresh_key_issues`' first refusal, naming its key (when a fresh model is built)."""
    for name, message in fresh_key_issues(config, overrides).items():
        raise AutomodelError(f"model.{name}: {message}")


def _set(config: Any, name: str, value: Any, key: str) -> None:
    issue = _key_issue(config, name, value, "a from_pretrained argument nor an attribute", nested=key.count(".") > 1)
    if issue:
        raise AutomodelError(f"{key}: {issue}")
    setattr(config, name, value)


def _key_issue(config: Any, name: str, value: Any, neither: str, nested: bool = False) -> str | None:
    """Why ``config`` cannot take the key ``name`` (None: it can)."""
    # a Qwen3.5 text config counts its MTP depths in either name (upstream's form: text_config.num_nextn_predict_layers)
    if hasattr(config, name) or (name in MTP_DEPTH_KEYS and config.model_type in MTP_TEXT_FAMILIES):
        return None
    if name == "num_nextn_predict_layers":
        return f"{value} asks for {MTP}; this model is {config.model_type}: remove it or use 0"
    what = "not an attribute" if nested else f"neither {neither}"
    return f"{what} of the {config.model_type} config; remove it (or correct its name)"
