"""Config-level forms of upstream NeMo AutoModel configs that the core implements (issue 20): keys ending in ``_fn``
name a callable that is passed, not called."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from automodel.config import BuildError, ConfigNode, Target, build_config, instantiate
from automodel.config.instantiate import callable_value
from automodel.errors import ConfigError
from automodel.recipe import BaseRecipe


class _Recipe(BaseRecipe):
    sections = {"model": Target("anything"), "dataloader": Target("a loader", plain=True,
                                                                  default_target="amt_targets.anything")}


def _issues(data, resolver):
    with pytest.raises(ConfigError) as info:
        build_config(data, _Recipe, resolver)
    return {i.key: i.message for i in info.value.issues}


# ---- keys ending in _fn ---------------------------------------------------------------------------------------

def test_fn_values_are_the_callable_as_is_or_a_partial_and_never_called(targets, resolver):
    assert callable_value("amt_targets.scaled_batch", resolver, "d.collate_fn") is targets.scaled_batch
    assert callable_value({"_target_": "amt_targets.scaled_batch"}, resolver, "d.collate_fn") is targets.scaled_batch
    bound = callable_value({"_target_": "amt_targets.scaled_batch", "scale": 2.0, "tag": "t"}, resolver,
                           "d.collate_fn")
    assert isinstance(bound, functools.partial) and bound.func is targets.scaled_batch
    assert bound.keywords == {"scale": 2.0, "tag": "t"}
    assert targets.CALLS == []  # nothing was called to get there
    assert bound([1, 2]) == {"items": [1, 2], "scale": 2.0, "tag": "t"}


def test_fn_key_inside_a_built_node_is_passed_not_called(targets, resolver):
    node = {"_target_": "amt_targets.anything", "size": 3,
            "collate_fn": {"_target_": "amt_targets.scaled_batch", "scale": 0.5},
            "worker_init_fn": "amt_targets.touch"}
    built = instantiate(node, resolver, "model")
    assert built["collate_fn"].func is targets.scaled_batch and built["collate_fn"].keywords == {"scale": 0.5}
    assert built["worker_init_fn"] is targets.touch
    assert targets.CALLS == []


def test_top_level_fn_section_is_built(targets, resolver):
    """``loss_fn`` is a section like any other (upstream builds it): only nested ``*_fn`` keys are passed."""
    assert instantiate({"_target_": "amt_targets.make_thing", "size": 2}, resolver, "loss_fn") == \
        {"size": 2, "color": "red"}


def test_fn_node_is_checked_against_the_callable_minus_what_the_caller_passes(targets, resolver):
    ok = {"model": {"_target_": "amt_targets.anything"},
          "dataloader": {"collate_fn": {"_target_": "amt_targets.scaled_batch", "scale": 2.0}}}
    build_config(ok, _Recipe, resolver)  # `batch` (the first parameter) is the caller's, not required
    issues = _issues({"model": {"_target_": "amt_targets.anything"},
                      "dataloader": {"collate_fn": {"_target_": "amt_targets.scaled_batch", "scael": 2.0}}},
                     resolver)
    assert "amt_targets.scaled_batch does not accept an argument 'scael' (it accepts: scale, tag)" in \
        issues["dataloader.collate_fn.scael"]


def test_fn_class_is_checked_against_its_constructor_with_the_tokenizer_supplied(targets, resolver):
    build_config({"model": {"_target_": "amt_targets.anything"},
                  "dataloader": {"collate_fn": {"_target_": "amt_targets.Collator", "suffix": "!"}}}, _Recipe, resolver)
    issues = _issues({"model": {"_target_": "amt_targets.anything"},
                      "dataloader": {"collate_fn": {"_target_": "amt_targets.Collator", "sufix": "!"}}}, resolver)
    assert "dataloader.collate_fn.sufix" in issues


def test_fn_class_built_with_the_processor_is_checked_and_built_with_it(targets, resolver):
    from automodel.training.builders import configured_collate

    node = {"_target_": "amt_targets.ProcessorCollator", "max_length": 8}
    build_config({"model": {"_target_": "amt_targets.anything"}, "dataloader": {"collate_fn": node}}, _Recipe,
                 resolver)  # `processor` is the recipe's (the VLM recipe's collate_runtime_args)
    issues = _issues({"model": {"_target_": "amt_targets.anything"},
                      "dataloader": {"collate_fn": {**node, "max_lenght": 8}}}, resolver)
    assert "dataloader.collate_fn.max_lenght" in issues and "dataloader.collate_fn.processor" not in issues
    collator = configured_collate(node, resolver, "dataloader.collate_fn", {"processor": "PROC", "tokenizer": "T"})
    assert collator([1]) == {"items": [1], "by": "PROC", "max_length": 8}


@pytest.mark.parametrize("value,key", [
    ({"_target_": "os.system"}, "dataloader.collate_fn._target_"),
    ("subprocess.run", "dataloader.collate_fn"),
    ({"_target_": "amt_targets.system"}, "dataloader.collate_fn._target_"),  # os.system re-exported
])
def test_fn_targets_go_through_the_allow_list(targets, resolver, value, key):
    issues = _issues({"model": {"_target_": "amt_targets.anything"}, "dataloader": {"collate_fn": value}}, resolver)
    assert key in issues
    with pytest.raises(ConfigError):
        callable_value(value, resolver, "dataloader.collate_fn")


def test_collate_fn_builder_passes_functions_and_builds_collator_classes_with_the_recipes_tokenizer(
        targets, resolver, tmp_path):
    from automodel.training.builders import _collate

    class Ctx:
        cfg = type("Cfg", (), {"resolver": resolver})()
        collate_args = {"tokenizer": "TOK", "processor": "ignored: the class does not take it"}

    def loader(collate_fn):
        return ConfigNode({"collate_fn": collate_fn}, "dataloader", resolver)

    partial = _collate(Ctx, loader({"_target_": "amt_targets.scaled_batch", "tag": "x"}), None)
    assert partial([1]) == {"items": [1], "scale": 1.0, "tag": "x"}
    collator = _collate(Ctx, loader({"_target_": "amt_targets.Collator", "suffix": "!"}), None)
    assert targets.CALLS == [("scaled_batch", 1.0, "x"), ("Collator", "TOK", "!")]  # built once, at build time
    assert collator([1]) == {"items": [1], "by": "TOK!"}
    Ctx.collate_args = {}
    with pytest.raises(BuildError, match="dataloader.collate_fn: building amt_targets.Collator failed"):
        _collate(Ctx, loader({"_target_": "amt_targets.Collator"}), None)


# ---- ${a.b.c}: a reference to another key when the config holds it, else the environment (upstream) ------------

def _interpolate(data):
    from automodel.config import interpolate

    issues = []
    return interpolate(data, issues), issues


def test_reference_takes_the_keys_value_with_its_type(monkeypatch):
    monkeypatch.setenv("optimizer.lr", "from the environment")  # a key the config holds wins over the variable
    out, issues = _interpolate({
        "optimizer": {"lr": 0.01, "betas": [0.9, 0.95]},
        "lr_scheduler": {"max_lr": "${optimizer.lr}", "first_beta": "${optimizer.betas.1}",
                         "note": "lr=${optimizer.lr} betas=${optimizer.betas.0}"},
        "copy": "${optimizer}",
    })
    assert issues == []
    assert out["lr_scheduler"] == {"max_lr": 0.01, "first_beta": 0.95, "note": "lr=0.01 betas=0.9"}
    assert out["copy"] == {"lr": 0.01, "betas": [0.9, 0.95]}


def test_references_chain_and_see_interpolated_values(monkeypatch):
    monkeypatch.setenv("AMT_ROOT", "/runs")
    out, issues = _interpolate({"paths": {"root": "${AMT_ROOT}", "run": "${paths.root}/a"},
                                "checkpoint": {"checkpoint_dir": "${paths.run}/ckpt"}})
    assert issues == [] and out["checkpoint"]["checkpoint_dir"] == "/runs/a/ckpt"


def test_a_name_the_config_does_not_hold_is_an_environment_variable_as_upstream(monkeypatch):
    monkeypatch.setenv("forms.train.samples", "12")
    out, issues = _interpolate({"dataset": {"n": "${forms.train.samples}", "m": "${forms.val.samples,4}",
                                            "lr": "${oc.env:dataset.n,7}"}})
    assert issues == [] and out["dataset"] == {"n": 12, "m": 4, "lr": 7}  # oc.env: always the environment


@pytest.mark.parametrize("data,key,chain", [
    ({"a": "${b}", "b": "${a}"}, "a", "a -> b -> a"),
    ({"a": {"x": "${a}"}}, "a.x", "a.x -> a.x"),
    ({"a": "${a}"}, "a", "a -> a"),
    ({"l": ["${m}"], "m": "x${l.0}"}, "l[0]", "l.0 -> m -> l.0"),
])
def test_reference_cycles_are_an_error_naming_the_chain(data, key, chain):
    _, issues = _interpolate(data)
    assert [i.key for i in issues] == [key]
    assert f"the references form a cycle: {chain}" in issues[0].message


def test_a_section_inside_a_string_and_a_missing_key_are_errors():
    _, issues = _interpolate({"a": {"b": 1}, "c": "x-${a}", "d": "${nothing.here}"})
    messages = {i.key: i.message for i in issues}
    assert "${a} is a dict; only a whole value may reference a section or a list" in messages["c"]
    assert "environment variable 'nothing.here' is not set, the config has no key of that name" in messages["d"]


def test_references_see_overrides_and_printing_keeps_the_placeholder(targets, resolver):
    cfg = build_config({"model": {"_target_": "amt_targets.anything", "size": 2, "twice": "${model.size}"}},
                       _Recipe, resolver, overrides=[("model.size", 5)])
    assert cfg.model["twice"] == 5
    assert "twice: ${model.size}" in cfg.to_yaml()


# ---- top-level seed (upstream): rng.seed under another name, ranked as upstream's -----------------------------

def _toy(tmp_path, **sections):
    from automodel.plugins.manager import get_plugin_manager
    from automodel.testing import ToyRecipe, toy_config

    data = toy_config(tmp_path / "ckpt", **sections)
    return ToyRecipe, build_config(data, ToyRecipe, get_plugin_manager().resolver())


def test_top_level_seed_is_the_runs_seed_ranked_as_upstream(tmp_path):
    _, cfg = _toy(tmp_path, rng=None, seed=7)
    assert (cfg.rng.seed, cfg.rng.ranked, cfg.seed) == (7, True, 7)
    _, cfg = _toy(tmp_path, rng={"seed": 7, "ranked": False}, seed=7)  # the same value twice is fine
    assert (cfg.rng.seed, cfg.rng.ranked) == (7, False)


def test_top_level_seed_wins_over_a_different_rng_seed_and_the_note_says_so(tmp_path):
    # upstream's recipes read only the top-level seed (7 of its files also carry rng: {seed: 1111})
    _, cfg = _toy(tmp_path, rng={"seed": 1111, "ranked": False}, seed=42)
    assert (cfg.rng.seed, cfg.rng.ranked, cfg.seed) == (42, False, 42)
    named = [n for n in cfg.notes if "rng.seed" in n]
    assert len(named) == 1 and named[0].startswith("note: seed: 42 is the value that acts, not rng.seed: 1111 (")
    _, cfg = _toy(tmp_path, rng={"seed": 42}, seed=42)
    assert not [n for n in cfg.notes if "rng.seed" in n]


def test_top_level_seed_seeds_the_run(tmp_path):
    from automodel.testing import read_jsonl

    def losses(name, **sections):
        recipe_cls, cfg = _toy(tmp_path / name, **sections)
        recipe = recipe_cls(cfg)
        recipe.setup()
        recipe.run_train_validation_loop()
        return [r["loss"] for r in read_jsonl(tmp_path / name / "ckpt" / "training.jsonl")]

    by_rng = losses("rng", rng={"seed": 5})
    assert losses("seed", rng=None, seed=5) == by_rng
    assert losses("both", rng={"seed": 1111}, seed=5) == by_rng  # the top-level seed wins, as upstream
    assert losses("other", rng=None, seed=6) != by_rng


@pytest.mark.parametrize("deterministic", [False, True])
def test_rng_deterministic_turns_on_torchs_deterministic_algorithms(tmp_path, capsys, deterministic):
    import torch

    recipe_cls, cfg = _toy(tmp_path, rng={"seed": 1, "deterministic": deterministic})
    try:
        recipe_cls(cfg).setup()
        assert torch.are_deterministic_algorithms_enabled() is deterministic
        assert ("rng.deterministic: torch runs deterministic algorithms only" in capsys.readouterr().err) \
            is deterministic
        # in deterministic mode torch also fills new memory (NaN for floats) instead of leaving what was there
        if deterministic:
            assert torch.empty(64).isnan().all()
    finally:
        torch.use_deterministic_algorithms(False)


# ---- dist_env: init_method, master_addr / master_port -----------------------------------------------------------

def test_init_method_reaches_init_process_group(monkeypatch):
    import torch.distributed as dist

    from automodel.training.dist import init_process_group

    calls, lines = [], []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    init_process_group("gloo", 3, lines.append, "tcp://10.0.0.1:2345")
    backend, kwargs = calls[0]
    assert (backend, kwargs["init_method"], kwargs["rank"], kwargs["world_size"]) == \
        ("gloo", "tcp://10.0.0.1:2345", 1, 2)  # tcp:// and file:// need rank and world size from torchrun
    assert kwargs["timeout"].total_seconds() == 180
    assert lines == ["process group: gloo, 2 processes, rendezvous tcp://10.0.0.1:2345"]


@pytest.mark.parametrize("dist_env,key,fragment", [
    ({"init_method": "zmq://x"}, "dist_env.init_method", "not a rendezvous URL"),
    ({"init_method": "tcp://h:1", "master_port": 5}, "dist_env.init_method", "names the rendezvous itself"),
    ({"master_port": 70000}, "dist_env.master_port", "must be a TCP port"),
])
def test_dist_env_refusals(tmp_path, dist_env, key, fragment):
    with pytest.raises(ConfigError) as info:
        _toy(tmp_path, dist_env=dist_env)
    assert any(i.key == key and fragment in i.message for i in info.value.issues), info.value.issues


def test_master_port_disagreeing_with_the_launchers_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29511")
    _toy(tmp_path, dist_env={"master_port": 29511})  # what the launcher was given: fine
    with pytest.raises(ConfigError, match="dist_env.master_port: 1234 but this process was started with "
                                          "MASTER_PORT=29511"):
        _toy(tmp_path, dist_env={"master_port": 1234})


def test_master_addr_and_port_are_the_launch_rendezvous_unless_the_command_line_gives_one(tmp_path):
    from automodel.cli.execute import config_rendezvous
    from automodel.cli.launch import torchrun_command

    _, cfg = _toy(tmp_path, dist_env={"master_addr": "10.1.2.3", "master_port": 2345})
    cmd = torchrun_command({"nproc_per_node": 2}, ["run", "-c", "x.yaml"], *config_rendezvous(cfg))
    assert "--master-addr=10.1.2.3" in cmd and "--master-port=2345" in cmd
    flags = torchrun_command({"nproc_per_node": 2, "master_port": 4444}, [], *config_rendezvous(cfg))
    assert "--master-port=4444" in flags
    _, unset = _toy(tmp_path, dist_env={})
    assert config_rendezvous(unset) == ("localhost", 29500)


def test_config_master_port_rendezvous_of_a_two_process_run(tmp_path):
    from automodel.testing import free_port, run_cli, toy_config, write_yaml

    port = free_port()
    write_yaml(tmp_path / "toy.yaml", toy_config(tmp_path / "ckpt", step_scheduler={"max_steps": 2},
                                                dist_env={"master_port": port, "init_method": "env://"}))
    result = run_cli("run", "-c", "toy.yaml", "--nproc-per-node", "2", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--master-port={port}" in result.stderr
    assert "process group: gloo, 2 processes, rendezvous env://" in result.stderr


# ---- model.backend (upstream's BackendConfig) ---------------------------------------------------------------------

def test_backend_settings_that_act_select_the_attention():
    from automodel.model_backend import BackendConfig, apply_backend

    assert BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False, experts="torch",
                         dispatcher="torch", enable_hf_state_dict_adapter=True).attn_implementation == "eager"
    for backend in (BackendConfig(attn="sdpa"), {"attn": "sdpa", "_target_": "BackendConfig"}, {"attn": "sdpa"}):
        kwargs = {"backend": backend, "num_hidden_layers": 1}
        apply_backend(kwargs)
        assert kwargs == {"attn_implementation": "sdpa", "num_hidden_layers": 1}  # backend never reaches the model
    kwargs = {"backend": {"linear": "torch"}}
    apply_backend(kwargs)
    assert kwargs == {}


@pytest.mark.parametrize("setting,value,fragment", [
    ("attn", "te", "needs CUDA and its attention kernels"),
    ("attn", "tilelang", "needs CUDA"),
    ("attn", "flex", "FlexAttention has no backward pass on a CPU"),
    ("linear", "te", "needs CUDA and Transformer Engine"),
    ("rms_norm", "te", "needs CUDA and Transformer Engine"),
    ("rope", "quack", "needs CUDA and QuACK"),
    ("rope_fusion", True, "needs CUDA and Transformer Engine"),
    ("experts", "gmm", "grouped-GEMM kernels"),
    ("dispatcher", "deepep", "DeepEP"),
    ("dispatcher_num_sms", 64, "sets the CUDA MoE dispatchers"),
    ("enable_deepep", True, "was removed upstream"),
    ("fake_gate_noise", 0.3, "routes exactly balanced"),
    ("enable_hf_state_dict_adapter", "no", "must be true or false"),
    ("te_fp8", {"recipe": "delayed"}, "Transformer Engine"),
    ("gate_precision", "float8", "not a floating dtype for the router's logits"),
    ("gate_precision", "int32", "not a floating dtype for the router's logits"),
    ("compile_attn", "yes", "must be true"),
    ("cuda_graph", {"enabled": True}, "CUDA graphs"),
    ("fake_balanced_gate", "yes", "must be true"),
    ("enable_fsdp_optimizations", "on", "must be true"),
])
def test_backend_settings_that_cannot_act_are_refused_with_the_reason(setting, value, fragment):
    from automodel.model_backend import BackendConfig, backend_issues

    assert fragment in backend_issues({setting: value})[setting]
    with pytest.raises(ValueError, match=setting):
        BackendConfig(**{setting: value})


def test_hf_state_dict_adapter_false_is_accepted_with_a_note_on_the_layout_it_keeps():
    from automodel.model_backend import backend_issues
    from automodel.training.inert_notes import inert_distributed_notes

    assert backend_issues({"enable_hf_state_dict_adapter": False}) == {}
    for value, noted in ((False, True), (True, False), (None, False)):
        notes = inert_distributed_notes(SimpleNamespace(model={"backend": {"enable_hf_state_dict_adapter": value}},
                                                        distributed=None), fsdp2=False)
        assert any("enable_hf_state_dict_adapter: false keeps a model's own weight layout" in n
                   for n in notes) is noted


@pytest.mark.parametrize("value", ["float32", "torch.float32", "FP32", "bf16", "torch.bfloat16", "float16", "double"])
def test_gate_precision_takes_upstreams_dtype_names(value):
    from automodel.model_backend import backend_issues

    assert backend_issues({"gate_precision": value}) == {}


def test_every_backend_setting_has_a_reason_for_the_values_it_refuses():
    from automodel.model_backend import ACTS, REASONS

    assert set(ACTS) == set(REASONS)


def test_backend_checks_of_the_model_node():
    from automodel.model_backend import model_backend_issues

    assert model_backend_issues({"backend": {"attn": "sdpa", "rms_norm": "torch"}}) == {}
    issues = model_backend_issues({"backend": {"attn": "sdpa", "rms_norm": "torch", "colour": 1},
                                   "attn_implementation": "eager", "torch_dtype": "bfloat16"})
    assert set(issues) == {"backend.attn", "backend.colour"}  # rms_norm torch acts in bf16 too
    assert "give one of them" in issues["backend.attn"]
    # upstream's Qwen3.5 form: backend attn sdpa (its own language model) and a CUDA-only attn_implementation; the
    # model's own check refuses that one for the hardware, and the two agree once it is replaced
    assert model_backend_issues({"backend": {"attn": "sdpa"}, "attn_implementation": "flash_attention_2"}) == {}
    assert model_backend_issues({"backend": {"attn": "sdpa"}, "attn_implementation": "sdpa"}) == {}
    # a _target_ node's settings are its own check's (see the next test); the model checks what spans both
    assert model_backend_issues({"backend": {"_target_": "BackendConfig", "attn": "te"}}) == {}


def test_backend_node_is_checked_by_its_own_check_at_validation(targets):
    from automodel.config import Registration, TargetResolver, core_registry

    resolver = TargetResolver(core_registry().extended([Registration("amt_targets", "prefix", "t")]),
                              {"BackendConfig": "automodel.model_backend.BackendConfig"})
    issues = _issues({"model": {"_target_": "amt_targets.anything",
                                "backend": {"_target_": "BackendConfig", "attn": "te", "linear": "torch"}}},
                     resolver)
    assert list(issues) == ["model.backend.attn"] and "needs CUDA" in issues["model.backend.attn"]


# ---- metadata sections: not interpolated, not validated, named in one note; launcher sections refused ----------

def test_metadata_sections_are_left_unread_and_named_in_one_note(tmp_path, monkeypatch):
    monkeypatch.delenv("AMT_UNSET_TOKEN", raising=False)
    # (what could run code is refused even there: tests/test_security_hostile.py)
    ci = {"recipe_owner": "x", "nightly": {"dataset": {"_target_": "some_ci_tool.NightlyData"}, "nodes": 2,
                                           "token": "${AMT_UNSET_TOKEN}"}}
    aside = {"_target_": "nemo_automodel.components.datasets.llm.hellaswag.HellaSwag"}
    _, cfg = _toy(tmp_path, ci=ci, _validation_dataset=aside, _template="a YAML anchor's holder")
    assert cfg.notes == ["note: not validated and read by nothing in the run: 'ci' (upstream's CI settings, which "
                         "its CI tooling reads), '_validation_dataset' (a top-level key starting with '_'), "
                         "'_template' (a top-level key starting with '_')"]
    assert cfg.resolved["ci"] == ci  # as written: no placeholder replaced, no target resolved
    _, plain = _toy(tmp_path)
    assert plain.notes == []


def test_launcher_sections_are_named_in_the_note_without_reading_them(tmp_path, monkeypatch):
    monkeypatch.delenv("AMT_UNSET_TOKEN", raising=False)
    skypilot = {"hf_token": "${AMT_UNSET_TOKEN}", "num_nodes": 2}
    _, cfg = _toy(tmp_path, skypilot=skypilot, nemo_run={"executor": "slurm"})
    assert len(cfg.notes) == 1  # the unset variable inside is not read: no error, one note
    assert "'skypilot' (upstream's CLI submits the job through SkyPilot with it; automodel launches here, with " \
           "torchrun" in cfg.notes[0] and "'nemo_run' (upstream's CLI submits the job through NeMo-Run" in cfg.notes[0]
    assert cfg.resolved["skypilot"] == skypilot  # as written


def test_references_may_read_a_metadata_holder(tmp_path):
    _, cfg = _toy(tmp_path, _vars={"lr": 0.5, "steps": 3}, optimizer={"lr": "${_vars.lr}"},
                  step_scheduler={"max_steps": "${_vars.steps}"})
    assert cfg.optimizer["lr"] == 0.5 and cfg.step_scheduler.max_steps == 3
    assert "'_vars' (a top-level key starting with '_')" in cfg.notes[0]
