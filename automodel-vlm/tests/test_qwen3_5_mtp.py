"""Upstream's MTP heads on a tiny Qwen3.5 vision-language model (automodel.mtp.qwen3_5): the heads read a
checkpoint's ``mtp.*`` tensors under Qwen's names and save them back so, a run in upstream's form logs the
next-token loss plus the scaled mean of the depths' losses (computed here by hand), transformers loads what it
saved, and what the heads are not wired into is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from vlm_testing import images_only_qwen_vl_processor_class, tiny_qwen_vl_processor

from automodel import testing
from automodel.errors import ConfigError
from automodel.training.loss import IGNORE_INDEX
from automodel_vlm import AutoModelForImageTextToText

FORM = Path(__file__).parent / "upstream_forms" / "qwen3_5_mtp_upstream.yaml"
ROUTE = ("finetune", "vlm")
TEXT = {"model_type": "qwen3_5_text", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "full_attention_interval": 2, "mtp_num_hidden_layers": 1, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": 0, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [1, 1, 2], "mrope_interleaved": True}}
VISION = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
          "out_hidden_size": 32, "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint as transformers saves it plus one MTP depth's ``mtp.*`` tensors under Qwen's names
    (``mtp.fc``, ``mtp.layers.0.self_attn...``, ``mtp.norm``), and its processor, in one directory."""
    from transformers import AutoProcessor, Qwen3_5Config

    AutoProcessor.register(Qwen3_5Config, images_only_qwen_vl_processor_class(), exist_ok=True)
    processor = tiny_qwen_vl_processor()
    tokenizer = processor.tokenizer
    config = {"model_type": "qwen3_5", "text_config": {**TEXT, "vocab_size": len(tokenizer)},
              "vision_config": VISION, "image_token_id": processor.image_token_id,
              "video_token_id": processor.video_token_id,
              "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>")}
    path = tmp_path_factory.mktemp("qwen3_5")
    model = AutoModelForImageTextToText.from_config(config, mtp_loss_scaling_factor=0.1, seed=0)
    heads = {f"mtp.{key}": value.clone() for key, value in model.mtp.state_dict().items()}
    heads = {key: torch.randn_like(value) * 0.1 + value for key, value in heads.items()}  # not the fresh init
    del model.mtp
    model.save_pretrained(path)
    save_file({**load_file(path / "model.safetensors"), **heads}, path / "model.safetensors",
              metadata={"format": "pt"})
    processor.save_pretrained(path)
    return path


def test_the_heads_read_qwens_names_and_save_them_back_as_they_were(tmp_path, qwen_dir):
    saved = {key: value for key, value in load_file(qwen_dir / "model.safetensors").items()
             if key.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(saved)
    model = AutoModelForImageTextToText.from_pretrained(qwen_dir, text_config={"mtp_num_hidden_layers": 1},
                                                        mtp_loss_scaling_factor=0.1)
    assert model.mtp.origin == f"read from the checkpoint's {len(saved)} mtp.* tensors"
    assert model.mtp.settings.depths == 1 and model.mtp.settings.scaling_factor == 0.1
    model.save_pretrained(tmp_path)
    again = {key: value for key, value in load_file(tmp_path / "model.safetensors").items()
             if key.startswith("mtp.")}
    assert again.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0)


def test_a_checkpoint_of_other_depths_is_refused_naming_the_tensors(qwen_dir):
    with pytest.raises(Exception, match=r"do not fit 2 MTP depths .*missing: layers\.1\."):
        AutoModelForImageTextToText.from_pretrained(qwen_dir, num_nextn_predict_layers=2)


@pytest.mark.parametrize("packed", [False, True])
def test_the_logged_loss_is_the_next_token_loss_plus_the_scaled_mean_of_the_depths(tmp_path, qwen_dir, packed):
    """Packed rows (text positions restarting per sample on the first of four rotary axes): a depth's target in the
    next sample is none."""
    by_hand = []

    def record(run):
        compute, outputs = run.compute_loss, []
        run.mtp_heads.register_forward_hook(lambda module, args, output: outputs.append(output))

        def computed(model, batch):
            loss = compute(model, batch)
            with torch.no_grad():
                inputs = {k: v for k, v in batch.items() if k not in ("labels", "label_positions", "token_count")}
                logits = model(**inputs, use_cache=False).logits
                labels, ce = batch["labels"], torch.nn.functional.cross_entropy
                main = ce(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
                sample = (batch["position_ids"][0] == 0).cumsum(dim=1) if packed else torch.zeros_like(labels)
                assert ("position_ids" in batch) == packed
                depths = [ce(model.lm_head(hidden)[:, :-k - 1].flatten(0, 1), labels[:, k + 1:].masked_fill(
                    sample[:, k + 1:] != sample[:, :-k - 1], IGNORE_INDEX).flatten(), reduction="sum")
                          for k, hidden in enumerate(outputs[-1], 1)]
                tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
                by_hand.append(((main / tokens).item(), ((main + 0.3 * sum(depths) / len(depths)) / tokens).item()))
                assert (batch["input_ids"] == model.config.image_token_id).any()  # image rows
            return loss

        run.compute_loss = computed

    testing.train_inprocess(FORM, "--model.pretrained_model_name_or_path", qwen_dir,
                            "--processor.pretrained_model_name_or_path", qwen_dir, "--checkpoint.checkpoint_dir",
                            tmp_path / "ckpt", "--step_scheduler.max_steps", "1",
                            *(("--packed_sequence", "{pack_size: 256, pretokenize: true}") if packed else ()),
                            route=ROUTE, before_run=record)
    logged = testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")[0]["loss"]
    (main_only, expected), = by_hand
    assert logged == pytest.approx(expected, rel=1e-5)
    assert abs(logged - main_only) > 1e-3  # the heads' loss is in what is logged


@pytest.mark.parametrize("on_meta", [False, True])
def test_upstream_form_trains_the_heads_and_transformers_loads_the_saved_model(tmp_path, qwen_dir, on_meta):
    """The engine builds the model on the meta device (the text_config keys set on the checkpoint's config) and
    reads the heads' tensors with the model's; a from_pretrained argument (``use_safetensors``) leaves the loading to
    ``from_pretrained``, and the heads' tensors are read from the checkpoint's files."""
    from transformers import AutoModelForImageTextToText as HFModel

    loading = [] if on_meta else ["--model.use_safetensors", "true"]
    recipe = testing.train_inprocess(FORM, "--model.pretrained_model_name_or_path", qwen_dir,
                                     "--processor.pretrained_model_name_or_path", qwen_dir,
                                     "--checkpoint.checkpoint_dir", tmp_path / "ckpt", *loading, route=ROUTE)
    assert recipe.mtp_heads.origin.startswith("read with the model" if on_meta else "read from the checkpoint's")
    assert testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")[-1]["step"] == 2
    out = tmp_path / "ckpt" / "epoch_0_step_2" / "model"
    saved = load_file(out / "model.safetensors")
    original = load_file(qwen_dir / "model.safetensors")
    heads = {key for key in saved if key.startswith("mtp.")}
    assert heads == {key for key in original if key.startswith("mtp.")}
    assert not torch.equal(saved["mtp.fc.weight"], original["mtp.fc.weight"])  # trained
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    plain = HFModel.from_pretrained(out).eval()  # ignores mtp.*
    ours = AutoModelForImageTextToText.from_pretrained(out, mtp_loss_scaling_factor=0.1).eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    torch.testing.assert_close(plain(input_ids=ids).logits, ours(input_ids=ids).logits)
    for key in heads:
        torch.testing.assert_close(ours.state_dict()[key], saved[key], rtol=0, atol=0)


def refusals(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, "--model.pretrained_model_name_or_path", "x", "--processor."
                            "pretrained_model_name_or_path", "x", *overrides, route=ROUTE)  # later ones win
    return {issue.key: issue.message for issue in info.value.issues}


@pytest.mark.parametrize("override, words", [
    (("--distributed", "{strategy: fsdp2, tp_size: 2}"), "not wired into tensor parallelism"),
    (("--distributed", "{strategy: fsdp2, cp_size: 2}"), "not wired into context parallelism"),
])
def test_what_the_heads_are_not_wired_into_is_refused(override, words):
    assert words in refusals(*override)["model.mtp_loss_scaling_factor"]


def test_context_parallelism_runs_the_linear_attention_layers_whole_and_ring_attention_is_refused(qwen_dir):
    """Validation reads the checkpoint's config: its linear-attention layers run on the whole rows under the
    all-gather attention (auto's choice here), which torch's ring attention cannot do."""
    found = refusals("--model.pretrained_model_name_or_path", str(qwen_dir), "--distributed",
                     "{strategy: fsdp2, cp_size: 2}")
    assert "distributed.cp_size" not in found and "not wired into context parallelism" in \
        found["model.mtp_loss_scaling_factor"], found  # the heads are refused, the layers are not
    found = refusals("--model.pretrained_model_name_or_path", str(qwen_dir), "--distributed",
                     "{strategy: fsdp2, cp_size: 2, cp_attention: ring}")
    assert "1 of the model's layers are recurrent" in found["distributed.cp_size"], found


def test_pipeline_parallelism_is_not_refused_for_the_heads():
    """The heads run on the last pipeline stage with the rope positions every stage gets (before: refused)."""
    found = refusals("--distributed", "{strategy: fsdp2, pp_size: 2}", "--nonexistent_section", "1")
    assert not [key for key in found if key.startswith("model.")], found


@pytest.fixture(scope="module")
def pp_mtp(tmp_path_factory) -> list[list[dict]]:
    """Qwen3.5 and Qwen3.5-MoE with two MTP depths: three steps in one process and over pp 2 on two gloo ranks,
    launched together (``vlm_context_parallel_workers.py``'s ``vlm_pp_mtp``)."""
    from parallel_testing import launch_together

    tmp = tmp_path_factory.mktemp("vlm_pp_mtp")
    return launch_together([("vlm_pp_mtp", 0, tmp / "one", {}), ("vlm_pp_mtp", 2, tmp / "pp2", {})],
                           workers=Path(__file__).with_name("vlm_context_parallel_workers.py"), timeout=300)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_5_static"])
def test_pp2_trains_the_heads_like_one_process(pp_mtp, family):
    """The recipe's pipelined step on two ranks (1F1B over one-row micro-batches; a first micro-batch without an
    image, then rows with images of three sizes, right-padded, then packed rows of two conversations): the first
    stage embeds both depths' tokens ahead, they travel to the last, whose heads take the 3-D rope positions of the
    image rows (computed on the whole rows before the schedule) moved with the tokens, and a packed row's text
    positions for the targets; every rank's losses (with the heads') and gradient norms, and the heads' weights
    after the three steps, are one process's (static: the vision tower frozen, static stage shapes of 128 positions
    with the depths' embeddings among the tensors the stages exchange)."""
    (one,), ranks = pp_mtp
    one = one[family]
    for rank in ranks:
        assert rank[family]["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert rank[family]["norms"] == pytest.approx(one["norms"], rel=1e-5)
    heads = ranks[-1][family]["heads"]  # the last stage's rank holds them
    assert not ranks[0][family]["heads"] and sorted(heads) == sorted(one["heads"])
    for key, value in one["heads"].items():
        torch.testing.assert_close(torch.tensor(heads[key]), torch.tensor(value), rtol=1e-4, atol=1e-6)


def test_the_moe_heads_fuse_the_checkpoints_per_expert_tensors():
    """Qwen3.6-35B-A3B's files hold each expert's projections apart; the heads hold transformers' fused ones."""
    from automodel.mtp.qwen3_5 import checkpoint_tensors

    text = {**TEXT, "model_type": "qwen3_5_moe_text", "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
    config = {"model_type": "qwen3_5_moe", "text_config": text, "image_token_id": 60, "video_token_id": 61,
              "vision_config": {**VISION, "model_type": "qwen3_5_moe_vision"}, "vision_start_token_id": 62}
    model = AutoModelForImageTextToText.from_config(config, mtp_loss_scaling_factor=0.1, seed=0).train()
    model(input_ids=torch.randint(0, 59, (2, 12)))
    assert len(model.mtp._outputs) == 1  # the heads ran in the model's forward
    state = model.mtp.state_dict()
    files = {f"mtp.{key}": value for key, value in state.items() if ".experts." not in key}
    half = state["layers.0.mlp.experts.gate_up_proj"].shape[1] // 2
    for expert in range(4):
        for name, value in (("gate_proj", state["layers.0.mlp.experts.gate_up_proj"][expert, :half]),
                            ("up_proj", state["layers.0.mlp.experts.gate_up_proj"][expert, half:]),
                            ("down_proj", state["layers.0.mlp.experts.down_proj"][expert])):
            files[f"mtp.layers.0.mlp.experts.{expert}.{name}.weight"] = value
    fused = {key.removeprefix("mtp."): value for key, value in checkpoint_tensors(files).items()}
    assert fused.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(fused[key], value, rtol=0, atol=0)


def test_an_image_rows_heads_take_the_multi_axis_positions_moved_with_the_tokens(qwen_dir):
    """The depth's layer gets the rotary positions the model computed for the image row (get_rope_index), moved one
    place left; plain text positions would give other hidden states."""
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.masking_utils import create_causal_mask
    from vlm_testing import conversation

    from automodel.mtp.heads import shift_left

    processor = AutoProcessor.from_pretrained(qwen_dir)
    image = Image.new("RGB", (32, 32), "red")
    text = processor.apply_chat_template(conversation("What colour?", "red", image=image), tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(qwen_dir, mtp_loss_scaling_factor=0.1).train()
    hidden = []
    model.model.language_model.norm.register_forward_hook(lambda module, args, output: hidden.append(output))
    with torch.no_grad():
        model(**inputs)
        (got,) = model.mtp._outputs
        positions, _ = model.model.get_rope_index(inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
                                                  attention_mask=inputs["attention_mask"],
                                                  mm_token_type_ids=inputs["mm_token_type_ids"])
        assert not torch.equal(positions[0], positions[1])  # the image's 2D placement
        heads, language = model.mtp, model.model.language_model
        embedded = language.embed_tokens(shift_left(inputs["input_ids"], 1, 0))

        def depth(rotary):
            fused = heads.fc(torch.cat([heads.pre_fc_norm_embedding(embedded), heads.pre_fc_norm_hidden(hidden[0])],
                                       dim=-1))
            mask = create_causal_mask(config=language.config, inputs_embeds=fused,
                                      attention_mask=inputs["attention_mask"], cache=None, position_ids=None)
            return heads.norm(heads.layers[0](fused, position_embeddings=language.rotary_emb(fused, rotary),
                                              attention_mask=mask))

        moved = torch.stack([shift_left(axis, 1, 0) for axis in positions])
        torch.testing.assert_close(got, depth(moved))
        plain = shift_left(torch.arange(positions.shape[-1]).expand(1, -1), 1, 0).expand(3, -1, -1)
        assert not torch.allclose(got, depth(plain))


def test_upstreams_text_config_count_sets_the_depths_and_a_count_of_0_turns_them_off(qwen_dir):
    model = AutoModelForImageTextToText.from_pretrained(qwen_dir, text_config={"num_nextn_predict_layers": 1},
                                                        mtp_loss_scaling_factor=0.1)  # qwen3_6_35b.yaml's form
    assert model.mtp.settings.depths == 1 and model.config.text_config.mtp_num_hidden_layers == 1
    off = AutoModelForImageTextToText.from_pretrained(qwen_dir, text_config={"mtp_num_hidden_layers": 0},
                                                      mtp_loss_scaling_factor=0.1)  # step3p7's form
    assert getattr(off, "mtp", None) is None
    found = refusals("--model.pretrained_model_name_or_path", str(qwen_dir), "--model.text_config",
                     "{mtp_num_hidden_layers: 0}", "--distributed", "{strategy: fsdp2, tp_size: 2}")
    assert not [key for key in found if key.startswith("model.")], found  # no heads: tp is not refused for them
