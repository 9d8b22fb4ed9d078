"""Upstream's multi-token-prediction heads (``model.num_nextn_predict_layers``, automodel.mtp) on a tiny Nemotron-H:
the heads read NVIDIA's ``mtp.*`` tensors, the logged loss is the next-token loss plus the scaled mean of the
depths' losses, a run in upstream's form trains, resumes and saves the heads, transformers loads what it saved, and
what the heads are not wired into is refused at validation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from llm_testing import base_config, fsdp2_ranks_with, grad_norms, losses, run_finetune
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from automodel.errors import ConfigError
from automodel.testing import deep_update, load_config, read_jsonl, train_inprocess, write_yaml
from automodel.training.loss import IGNORE_INDEX
from automodel_llm import AutoModelForCausalLM

NEMOTRON_H = {"vocab_size": 482, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_size": 32,
              "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"], "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "mamba_num_heads": 4,
              "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "chunk_size": 8, "n_routed_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
              "num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"],
              "tie_word_embeddings": False}
UPSTREAM_KEYS = {"num_nextn_predict_layers": 2, "mtp_use_repeated_layer": True, "mtp_loss_scaling_factor": 0.3}


def nvidia_names(heads_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The heads' tensors as NVIDIA's checkpoints name them: ``mtp.`` first, one tensor per expert."""
    out = {}
    for key, value in heads_state.items():
        owner, name = key.rsplit(".", 1)
        if owner.endswith(".experts"):
            out.update({f"mtp.{owner}.{j}.{name}.weight": value[j].clone() for j in range(value.shape[0])})
        else:
            out[f"mtp.{key}"] = value.clone()
    return out


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    """A Nemotron-H checkpoint as transformers saves it plus one MTP depth's ``mtp.*`` tensors under NVIDIA's names
    (attention then MoE, as ``mtp_layers_block_type`` says)."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM as HFModel

    path = tmp_path_factory.mktemp("nemotron_h")
    torch.manual_seed(0)
    HFModel.from_config(AutoConfig.for_model("nemotron_h", **NEMOTRON_H)).save_pretrained(path)
    heads = AutoModelForCausalLM.from_config(str(path), num_nextn_predict_layers=1, seed=1).mtp
    state = load_file(path / "model.safetensors")
    save_file({**state, **nvidia_names(heads.state_dict())}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_the_heads_read_nvidia_names_stacking_the_experts(nemotron_dir):
    saved = load_file(nemotron_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(nemotron_dir, num_nextn_predict_layers=1)
    assert model.mtp.origin == "read from the checkpoint's 22 mtp.* tensors"
    state = model.state_dict()
    for key, value in saved.items():
        if not key.startswith("mtp."):
            continue
        owner, index, name = (key.split(".experts.")[0], *key.split(".experts.")[1].split(".")[:2])\
            if ".experts." in key else (None, None, None)
        mine = state[f"{owner}.experts.{name}"][int(index)] if owner else state[key]
        torch.testing.assert_close(mine, value, rtol=0, atol=0)
    assert model.config.num_nextn_predict_layers == 1


def test_a_checkpoint_of_other_depths_is_refused_naming_the_tensors(nemotron_dir):
    with pytest.raises(Exception, match=r"model\.num_nextn_predict_layers: the checkpoint's mtp\.\* tensors do not "
                                        r"fit 2 MTP depths .*missing: layers\.2\."):
        AutoModelForCausalLM.from_pretrained(nemotron_dir, num_nextn_predict_layers=2)


def run_config(tmp_path, nemotron_dir, name: str = "cfg.yaml", **sections):
    """A tiny fine-tuning run of the Nemotron-H checkpoint in upstream's form (its model target and MTP keys)."""
    data = base_config(nemotron_dir / "config.json", tmp_path / "ckpt")
    data["model"] = {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
                     "pretrained_model_name_or_path": str(nemotron_dir), **UPSTREAM_KEYS}
    return write_yaml(tmp_path / name, deep_update(data, sections))


def same_sample(position_ids: torch.Tensor | None, shape: torch.Size, ahead: int) -> torch.Tensor:
    """[rows, length - ahead]: whether the token ``ahead`` places on is in the same packed sample."""
    if position_ids is None:
        return torch.ones(shape[0], shape[1] - ahead, dtype=torch.bool)
    sample = (position_ids == 0).cumsum(dim=1)
    return sample[:, ahead:] == sample[:, :-ahead]


@pytest.mark.parametrize("packed", [False, True])
def test_the_logged_loss_is_the_next_token_loss_plus_the_scaled_mean_of_the_depths(tmp_path, nemotron_dir, packed):
    config = run_config(tmp_path, nemotron_dir,
                        step_scheduler={"max_steps": 1, "grad_accumulation_steps": 1, "log_interval": 1},
                        packed_sequence={"packed_sequence_size": 128} if packed else {})
    by_hand = []

    def record(run):
        compute = run.compute_loss
        heads, outputs = run.mtp_heads, []
        heads.register_forward_hook(lambda module, args, output: outputs.append(output))

        def computed(model, batch):
            loss = compute(model, batch)
            with torch.no_grad():
                ids, labels, positions = batch["input_ids"], batch["labels"], batch.get("position_ids")
                assert (positions is not None) == packed
                logits = model(input_ids=ids, attention_mask=batch.get("attention_mask"), position_ids=positions,
                               use_cache=False).logits
                ce = torch.nn.functional.cross_entropy
                main = ce(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
                depths = [ce(model.lm_head(hidden)[:, :-k - 1].flatten(0, 1),
                             labels[:, k + 1:].masked_fill(~same_sample(positions, ids.shape, k + 1), IGNORE_INDEX)
                             .flatten(), reduction="sum") for k, hidden in enumerate(outputs[-1], 1)]
                tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
                by_hand.append(((main / tokens).item(), ((main + 0.3 * sum(depths) / 2) / tokens).item()))
            return loss

        run.compute_loss = computed

    train_inprocess(config, before_run=record)
    logged = read_jsonl(tmp_path / "ckpt" / "training.jsonl")[0]["loss"]
    (main_only, expected), = by_hand
    assert logged == pytest.approx(expected, rel=1e-5)
    assert abs(logged - main_only) > 1e-3  # the heads' loss is in what is logged


def test_upstream_form_trains_resumes_and_saves_the_heads_for_transformers(tmp_path, nemotron_dir):
    from transformers import AutoModelForCausalLM as HFModel

    config = run_config(tmp_path, nemotron_dir, step_scheduler={
        "max_steps": 3, "grad_accumulation_steps": 1, "log_interval": 1, "checkpoint_interval": 2})
    log = run_finetune(config, tmp_path, tmp_path / "whole")
    assert "MTP: 2 heads (1 with weights of their own, read from the checkpoint's 22 mtp.* tensors)" in log
    run_finetune(config, tmp_path, tmp_path / "resumed", "--step_scheduler.max_steps", "2")
    run_finetune(config, tmp_path, tmp_path / "resumed", "--restore_from.path", "latest")
    assert losses(tmp_path / "resumed") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)

    out = tmp_path / "whole" / "epoch_0_step_3" / "model"
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        saved = {key: handle.get_tensor(key) for key in handle.keys()}
    with safe_open(str(tmp_path / "resumed" / "epoch_0_step_3" / "model" / "model.safetensors"), "pt") as handle:
        for key in saved:  # the resumed run restored the heads too: its saved model is the same
            torch.testing.assert_close(handle.get_tensor(key), saved[key], rtol=1e-5, atol=1e-6)
    heads = {key: value for key, value in saved.items() if key.startswith("mtp.")}
    original = load_file(nemotron_dir / "model.safetensors")["mtp.layers.0.eh_proj.weight"]
    assert not torch.equal(heads["mtp.layers.0.eh_proj.weight"], original)  # trained
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1  # one physical depth

    ours = AutoModelForCausalLM.from_pretrained(out, **UPSTREAM_KEYS)
    assert set(heads) == {f"mtp.{key}" for key in ours.mtp.state_dict()}
    for key, value in heads.items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=0, atol=0)
    plain = HFModel.from_pretrained(out)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    torch.testing.assert_close(plain.eval()(ids).logits, ours.eval()(ids).logits)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, nemotron_dir):
    """(config, checkpoint dir) of two steps in one process, each of two accumulated batches of two packed rows
    (several samples a row, position ids restarting at each) with every token a label, so a depth's target in the
    next sample would count without the rule that drops it."""
    tmp = tmp_path_factory.mktemp("mtp_one")
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"q": f"Which number follows {i}?", "a": f"It is {i + 1}, then {i + 2}."})
                            + "\n" for i in range(32)))
    dataset = {"_target_": "automodel_llm.datasets.ColumnMappedTextInstructionDataset", "dataset_name": str(rows),
               "column_mapping": {"question": "q", "answer": "a"}, "answer_only_loss_mask": False}
    config = run_config(tmp, nemotron_dir, step_scheduler={"max_steps": 2, "grad_accumulation_steps": 1,
                                                           "log_interval": 1},
                        dataloader={"batch_size": 2, "shuffle": False}, packed_sequence={"packed_sequence_size": 128},
                        dataset=dataset)
    run_finetune(config, tmp, tmp / "one", "--step_scheduler.grad_accumulation_steps", "2")
    return config, tmp / "one"


def heads_tensors(run) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of a run's step-2 model/."""
    saved = load_file(run / "epoch_0_step_2" / "model" / "model.safetensors")
    return {key: value for key, value in saved.items() if key.startswith("mtp.")}


def test_two_fsdp2_ranks_train_the_heads_as_one_process(tmp_path, one_process):
    config, reference = one_process
    run_finetune(config, tmp_path, tmp_path / "two", "--nproc-per-node", "2", "--distributed.strategy", "fsdp2")
    assert losses(tmp_path / "two") == pytest.approx(losses(reference), rel=1e-5)
    one, two = heads_tensors(reference), heads_tensors(tmp_path / "two")
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_expert_parallel_ranks_split_nemotron_hs_ungated_experts_and_train_as_one_process(tmp_path, one_process):
    """ep 2: Nemotron-H's experts (up_proj / down_proj, no gate: transformers' has_gate=False layout), the main
    model's and the MoE depth's, are split over the two ranks; losses, gradient norms, the trained experts and
    heads are one process's."""
    config, reference = one_process
    log = run_finetune(config, tmp_path, tmp_path / "ep", *fsdp2_ranks_with("ep_size"))
    assert "each rank holds 2 of 4 experts" in log
    assert losses(tmp_path / "ep") == pytest.approx(losses(reference), rel=1e-5)
    assert grad_norms(tmp_path / "ep") == pytest.approx(grad_norms(reference), rel=1e-5)
    saved = load_file(tmp_path / "ep" / "epoch_0_step_2" / "model" / "model.safetensors")
    expected = load_file(reference / "epoch_0_step_2" / "model" / "model.safetensors")
    assert any(key.endswith("experts.up_proj") for key in saved)
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_two_pipeline_stages_train_the_heads_as_one_process(tmp_path, one_process):
    """pp 2, two stages per rank (interleaved 1F1B, four stages): the first stage embeds the two depths' tokens
    ahead, the embeddings travel with the hidden states through the middle stages (their gradients back) to the
    last (static stage shapes: the packed length, the embeddings in them), which runs the (repeated-layer) heads
    and returns the depths' hidden states with the rows' positions; the schedule's loss
    (FusedLinearCrossEntropy: the head applied to the main and the depths' states) adds the heads', a depth's
    targets in the next packed sample dropped. Losses, gradient norms and the trained heads are one process's with
    the plain loss (wrong embeddings, states or targets change them all)."""
    config, reference = one_process
    log = run_finetune(config, tmp_path, tmp_path / "pp", *fsdp2_ranks_with("pp_size"),
                       "--step_scheduler.grad_accumulation_steps", "2", "--loss_fn._target_",
                       "FusedLinearCrossEntropy", "--loss_fn.chunk_len", "7", "--distributed.pipeline.pp_schedule",
                       "interleaved1f1b")
    assert "pipeline stages 0 (embedding + layers 0-0), 2 (layers 2-2) of 4 on this rank" in log
    assert "MTP under pipeline parallelism: the first stage sends each of the 2 depths' embedding" in log
    assert "pipeline stage shapes: static (pp_seq_len 128)" in log
    assert losses(tmp_path / "pp") == pytest.approx(losses(reference), rel=1e-5)
    assert grad_norms(tmp_path / "pp") == pytest.approx(grad_norms(reference), rel=1e-5)
    one, pp = heads_tensors(reference), heads_tensors(tmp_path / "pp")
    assert set(pp) == set(one)
    for key in one:
        torch.testing.assert_close(pp[key], one[key], rtol=1e-4, atol=1e-6)


def test_lora_adapts_the_heads_linear_layers_and_freezes_their_base(tmp_path, nemotron_dir):
    config = run_config(tmp_path, nemotron_dir, step_scheduler={"max_steps": 2, "log_interval": 1},
                        peft={"dim": 4, "alpha": 8, "match_all_linear": True, "exclude_modules": ["*.out_proj"]})
    run = train_inprocess(config)
    trained = {name for name, p in run.model.named_parameters() if p.requires_grad and ".mtp." in name}
    assert trained and all(".lora_" in name for name in trained)
    assert any("mtp.layers.0.eh_proj.lora_B" in name for name in trained)
    lora_b = run.model.get_submodule("base_model.model.mtp.layers.0.eh_proj").lora_B["default"].weight
    assert lora_b.abs().sum() > 0  # the heads' loss trained it (LoRA's B starts at zero)
    with safe_open(str(tmp_path / "ckpt" / "epoch_0_step_2" / "model" / "adapter_model.safetensors"), "pt") as file:
        assert "base_model.model.mtp.layers.0.eh_proj.lora_B.weight" in set(file.keys())


def refusals(config, route: tuple[str, str] = ("finetune", "llm")) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, route=route)
    return {issue.key: issue.message for issue in info.value.issues}


@pytest.mark.parametrize("sections, words", [
    ({"distributed": {"strategy": "fsdp2", "tp_size": 2}}, "not wired into tensor parallelism"),
    ({"distributed": {"strategy": "fsdp2", "cp_size": 2}}, "not wired into context parallelism"),
    ({"distributed": {"strategy": "fsdp2", "pp_size": 2, "cp_size": 2}}, "not wired into context parallelism"),
])
def test_what_the_heads_are_not_wired_into_is_refused(tmp_path, nemotron_dir, sections, words):
    found = refusals(run_config(tmp_path, nemotron_dir, **sections))
    assert words in found["model.num_nextn_predict_layers"], found
    assert "distributed.cp_size" not in found, found  # the Mamba layers run on the whole rows under cp


def test_other_families_and_lone_mtp_keys_are_refused(make_config):
    found = refusals(make_config(model={"num_nextn_predict_layers": 1}))
    assert "qwen3_5_moe); this model is llama" in found["model.num_nextn_predict_layers"]
    found = refusals(make_config(model={"mtp_use_repeated_layer": True}))
    assert "this model is llama" in found["model.mtp_use_repeated_layer"]
    found = refusals(make_config(model={"num_nextn_predict_layers": 0, "mtp_loss_scaling_factor": -1}))
    assert "expected a number >= 0" in found["model.mtp_loss_scaling_factor"]


def test_a_depths_count_in_the_config_mapping_asks_for_heads(tmp_path, make_config, capsys):
    """Upstream's form: the count in the model's config turns on the heads of a family that has them; another
    family's count builds none (upstream's GLM-4.7-Flash benchmark keeps its checkpoint's count; neither
    transformers' model nor upstream's has heads), which the run says instead of ignoring it silently."""
    model = AutoModelForCausalLM.from_config({"model_type": "nemotron_h", **NEMOTRON_H}, seed=1)  # its count: 1
    assert model.mtp.settings.depths == 1 and model.mtp.settings.asked_by == "model.config.num_nextn_predict_layers"
    tiny = {"model_type": "llama", "vocab_size": 482, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    config = make_config(model={"config": {**tiny, "num_nextn_predict_layers": 1}},
                         step_scheduler={"max_steps": 1})
    load_config(config, route=("finetune", "llm"))  # validates
    run = train_inprocess(config)
    assert getattr(run.model, "mtp", None) is None
    assert ("note: model.config.num_nextn_predict_layers: 1 builds no heads: upstream's multi-token-prediction "
            "heads (implemented here for nemotron_h") in capsys.readouterr().err
    found = refusals(make_config(model={"num_nextn_predict_layers": 1}))  # the section's own key asks, refused
    assert "this model is llama: remove the MTP keys" in found["model.num_nextn_predict_layers"], found


def test_distillation_refuses_mtp_keys_for_the_student_and_the_teacher(tmp_path, nemotron_dir):
    """The distillation loss adds no MTP loss, and the frozen teacher never runs heads."""
    teacher = {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
               "pretrained_model_name_or_path": str(nemotron_dir), **UPSTREAM_KEYS}
    found = refusals(run_config(tmp_path, nemotron_dir, teacher_model=teacher), route=("kd", "llm"))
    assert "whose loss this recipe does not add" in found["model.num_nextn_predict_layers"], found
    for key in UPSTREAM_KEYS:
        assert "the frozen teacher only serves its next-token logits" in found[f"teacher_model.{key}"], found


def test_a_scaling_factor_alone_trains_the_checkpoint_configs_heads(nemotron_dir):
    model = AutoModelForCausalLM.from_pretrained(nemotron_dir, mtp_loss_scaling_factor=0.2)  # upstream's Super V3
    assert model.mtp.settings.depths == 1 and model.mtp.settings.scaling_factor == 0.2


def test_a_copy_without_mtp_tensors_starts_the_heads_fresh(tmp_path, nemotron_dir):
    plain = tmp_path / "plain"
    shutil.copytree(nemotron_dir, plain)
    state = load_file(plain / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("mtp.")}, plain / "model.safetensors",
              metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(plain, num_nextn_predict_layers=1)
    assert model.mtp.origin == "freshly initialised (the checkpoint has no mtp.* tensors)"
    assert torch.isfinite(model.mtp.layers[1].mixer.experts.up_proj).all()


class Passthrough(torch.nn.Module):
    """A depth that adds the embedding of the token ahead to the hidden states."""

    def forward(self, hidden, embedded=None, **kwargs):
        return hidden + embedded


def test_a_target_in_the_next_packed_sample_is_not_a_target():
    from automodel.mtp.heads import MTPHeads, MTPSettings, future_embeddings

    torch.manual_seed(0)
    heads, embed, head = MTPHeads(MTPSettings(2), [Passthrough(), Passthrough()]), torch.nn.Embedding(9, 4), \
        torch.nn.Linear(4, 9)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # two packed samples of 4 tokens, every token a label
    heads.run(embed(ids), future_embeddings(ids, embed, 2), lambda depth: {})
    outputs = heads._outputs
    found = heads.loss(ids, head, torch.nn.CrossEntropyLoss(reduction="sum"), position_ids=positions)
    ce = torch.nn.functional.cross_entropy
    kept = {1: [0, 1, 4, 5], 2: [0, 4]}  # depth k at t predicts t + k + 1 within the sample
    expected = sum(ce(head(outputs[k - 1][0, rows]), ids[0, [t + k + 1 for t in rows]], reduction="sum")
                   for k, rows in kept.items())
    torch.testing.assert_close(found, expected * 0.1 / 2)


def test_preshifted_labels_are_each_depths_targets_one_position_earlier():
    """Labels that are the next tokens already (a data set's labels_shifted; the recipe's label_offset 0): depth
    ``k`` at ``t`` predicts the stream's token ``t + k + 1``, which is ``labels[t + k]``, within the sample."""
    from automodel.mtp.heads import MTPHeads, MTPSettings, future_embeddings

    torch.manual_seed(0)
    heads, embed, head = MTPHeads(MTPSettings(2), [Passthrough(), Passthrough()]), torch.nn.Embedding(12, 4), \
        torch.nn.Linear(4, 12)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])  # two packed samples: streams 1 .. 4, 10 and 5 .. 8, 11
    labels = torch.tensor([[2, 3, 4, 10, 6, 7, 8, 11]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    heads.run(embed(ids), future_embeddings(ids, embed, 2), lambda depth: {})
    outputs = heads._outputs
    found = heads.loss(labels, head, torch.nn.CrossEntropyLoss(reduction="sum"), position_ids=positions, offset=0)
    ce = torch.nn.functional.cross_entropy
    kept = {1: [0, 1, 2, 4, 5, 6], 2: [0, 1, 4, 5]}
    expected = sum(ce(head(outputs[k - 1][0, rows]), labels[0, [t + k for t in rows]], reduction="sum")
                   for k, rows in kept.items())
    torch.testing.assert_close(found, expected * 0.1 / 2)


@pytest.mark.parametrize("nested", ["config", "text_config"])
def test_depths_zero_in_the_config_built_from_leaves_the_factor_a_note(tmp_path, nemotron_dir, capsys, nested):
    """Upstream's DeepSeek-V4 / Step 3 form: the model's config sets ``num_nextn_predict_layers: 0`` and the
    section keeps ``mtp_loss_scaling_factor`` for when it is raised; no heads are asked for, so nothing the heads
    are not wired into is refused, and the run says the factor weighs nothing."""
    if nested == "config":
        model = {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
                 "config": {"_target_": "transformers.AutoConfig.from_pretrained",
                            "pretrained_model_name_or_path": str(nemotron_dir), "num_nextn_predict_layers": 0}}
    else:
        model = {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
                 "pretrained_model_name_or_path": str(nemotron_dir), "text_config": {"num_nextn_predict_layers": 0}}
    data = deep_update(base_config(nemotron_dir / "config.json", tmp_path / "ckpt"),
                       {"model": {**model, "mtp_loss_scaling_factor": 0.1}, "step_scheduler": {"max_steps": 2}})
    config = write_yaml(tmp_path / "cfg.yaml", {**data, "model": {**model, "mtp_loss_scaling_factor": 0.1}})
    assert "distributed.pp_size" not in str(load_config(config, "--distributed.strategy", "fsdp2")[1])
    run = train_inprocess(config)
    assert getattr(run.model, "mtp", None) is None
    assert "note: model.mtp_loss_scaling_factor: 0.1 governs nothing this run" in capsys.readouterr().err
    assert len(read_jsonl(tmp_path / "ckpt" / "training.jsonl")) == 2
