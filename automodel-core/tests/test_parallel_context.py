"""Context parallelism where this machine can test it: ring attention's refusal on CPU (and that torch's ring
attention indeed does not run here), how cp_attention: auto chooses, how a batch is split over two cp ranks (tokens,
positions and next-token targets stay together, the label tokens add up), FSDP's mesh over dp x cp, the all-gather
attention's mask, and the loop's context-parallel step with the all-gather attention on 2 and 4 gloo ranks against
one process (context_parallel_workers.py: a tiny Qwen2 with a sliding-window layer, on padded and packed rows; with
MaskedCrossEntropy and FusedLinearCrossEntropy; dp 2 x cp 2 and cp 2 x tp 2, with and without sequence
parallelism, on four)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_parallel_workers import lm_batch
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.errors import AutomodelError
from automodel.training.loss import IGNORE_INDEX
from automodel.training.next_token import NextTokenLogits
from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing
from automodel.training.parallel.all_gather_attention import (
    GatheredVisibility,
    SplitRegion,
    TwoWaySpans,
    causal_calls_to,
    documents,
)
from automodel.training.parallel.context_parallel import (
    ContextParallelBatch,
    causal_attention_without_mask,
    cp_attention,
    cp_issues,
    eager_issue,
    next_token_targets,
    recurrent_issue,
    split_sequence,
)


@pytest.fixture(scope="module")
def ranks(model_parallel_ranks):
    return [rank["cp"] for rank in model_parallel_ranks["two"]]


@pytest.fixture(scope="module")
def cp_steps(tmp_path_factory):
    """The loop's step: one process, cp 2 on two ranks, dp 2 x cp 2 and then cp 2 x tp 2 on four."""
    from parallel_testing import launch_together

    tmp = tmp_path_factory.mktemp("cp_steps")
    one, cp2, four = launch_together(
        [("cp", 0, tmp / "one", {"dp": 1}), ("cp", 2, tmp / "cp2", {"dp": 1}),
         ("cp", 4, tmp / "four", {"dp": 2, "tp": True})],
        workers=Path(__file__).with_name("context_parallel_workers.py"), timeout=600)
    return {"one": one[0], "cp2": cp2, "dp2_cp2": four, "cp2_tp2": [rank["tp2"] for rank in four],
            "cp2_tp2_sp": [rank["tp2_sp"] for rank in four]}


@pytest.mark.parametrize("layout, logits", [
    *((layout, logits) for layout in ("cp2", "dp2_cp2", "cp2_tp2")
      for logits in ("head", "all_positions", "fused_head", "fused_all_positions")),
    ("cp2_tp2_sp", "head"), ("cp2_tp2_sp", "fused_all_positions")])
def test_the_loops_context_parallel_step_equals_one_process(cp_steps, layout, logits):
    """Losses, gradient norms (the gradients' scale: dp * cp / tokens) and weights after three steps of two
    micro-batches (padded rows, packed rows); with the output head projecting only each rank's labelled positions,
    and every position; with MaskedCrossEntropy and with FusedLinearCrossEntropy (the loss inside the output head,
    on each rank's part of the sequences against its targets); cp 2 x tp 2 with the attention's heads sharded over
    tp (half of the query features on each rank) and the loss vocabulary-parallel, and with sequence parallelism
    (each tp rank's norm gets half of its cp part's 8 positions)."""
    one = cp_steps["one"][logits]
    shards = {"cp2_tp2": (8, 8), "cp2_tp2_sp": (8, 4)}.get(layout, (16, 8))
    for rank in cp_steps[layout]:
        ran = rank[logits]
        assert (ran["q_features"], ran["norm_positions"]) == shards
        assert (one["q_features"], one["norm_positions"]) == (16, 16)
        assert ran["losses"] == pytest.approx(one["losses"], abs=1e-5)
        assert ran["norms"] == pytest.approx(one["norms"], rel=1e-5)
        assert sorted(ran["state"]) == sorted(one["state"])
        for key, value in one["state"].items():
            assert torch.allclose(torch.tensor(ran["state"][key]), torch.tensor(value), atol=1e-5), key


def test_ring_attention_is_refused_on_cpu_saying_what_would_run_it():
    (issue,) = cp_issues("cpu", 2)
    assert issue.key == "distributed.cp_size"
    assert "flash or memory-efficient attention kernels on CUDA GPUs; this run is on cpu" in issue.message
    assert "set distributed.cp_attention: all_gather (any device) or set cp_size: 1" in issue.message
    assert cp_issues("cpu", 1) == []
    assert cp_issues("cpu", 2, attention="all_gather") == []
    assert cp_issues("cpu", 2, "eager", attention="all_gather") == []  # eager runs as SDPA in the region
    (flash,) = cp_issues("cpu", 2, "flash_attention_2", attention="all_gather")
    assert flash.key == "model.attn_implementation" and "use sdpa or eager" in flash.message


def test_auto_runs_ring_attention_only_where_it_computes_the_models_attention(monkeypatch):
    """CUDA, sdpa, no packing, no sliding windows: ring; anything else: all_gather; a setting other than auto is
    taken as it is."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: True)

    def cfg(attention="auto", pp_size=1, **sections):
        return SimpleNamespace(distributed=SimpleNamespace(cp_size=2, cp_attention=attention, pp_size=pp_size),
                               get=sections.get)

    llama = LlamaConfig()
    assert cp_attention(cfg(), "cuda", llama) == "ring"
    assert cp_attention(cfg(), "cpu", llama) == "all_gather"
    assert cp_attention(cfg(pp_size=2), "cuda", llama) == "all_gather"  # the schedule runs backward on its own
    assert cp_attention(cfg(model={"attn_implementation": "eager"}), "cuda", llama) == "all_gather"
    assert cp_attention(cfg(packed_sequence=SimpleNamespace(enabled=True)), "cuda", llama) == "all_gather"
    assert cp_attention(cfg(packed_sequence=SimpleNamespace(enabled=False, packed_sequence_size=0)), "cuda",
                        llama) == "ring"
    windowed = Qwen2Config(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2,
                           num_hidden_layers=2)
    assert cp_attention(cfg(), "cuda", windowed) == "all_gather"
    assert cp_attention(cfg(), "cuda", MistralConfig(sliding_window=8)) == "all_gather"  # every layer's window
    assert cp_attention(cfg(), "cuda", MistralConfig(sliding_window=None)) == "ring"
    assert cp_attention(cfg("ring"), "cpu", windowed) == "ring"


def test_the_all_gather_mask_is_causal_on_global_indices_within_documents_and_windows():
    """Rank 1 of 2 holds tokens 2, 3, 4, 5 of 8 (chunks 1 and 2 of 4); the gathered keys are rank 0's 0, 1, 6, 7
    then its own. A padding key is hidden; a packed row's document restarts where its position does not step by
    one; a window of 2 keeps the key one before the query; each query sees itself."""
    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    packed = GatheredVisibility(8, mesh, positions, None)
    assert packed.queries.tolist() == [2, 3, 4, 5] and packed.keys.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert documents(positions, None).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    seen = packed.mask_for(None)[0, 0]
    assert seen[0].tolist() == [True, True, False, False, True, False, False, False]  # token 2: 0, 1, 2
    assert seen[1].tolist() == [False, False, False, False, False, True, False, False]  # token 3 starts a document
    assert packed.mask_for(2)[0, 0, 3].tolist() == [False] * 6 + [True, True]  # token 5 with window 2: 4, 5
    padded = GatheredVisibility(8, mesh, torch.arange(8)[None], torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]]))
    assert documents(torch.arange(8)[None], torch.ones(1, 8)) is None  # with a mask, transformers' rule too
    seen = padded.mask_for(None)[0, 0]
    assert seen[1].tolist() == [True, True, False, False, True, True, False, False]  # token 3: 0 .. 3
    assert seen[3].tolist() == [True, True, False, False, True, True, False, True]  # padding 5: the real, itself
    left = GatheredVisibility(8, mesh, torch.arange(8)[None], torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))
    assert left.mask_for(None)[0, 0, 2].tolist() == [False] * 5 + [True, True, False]  # token 4: 3, 4, no padding


def test_two_way_spans_see_each_other_on_the_layers_the_model_says_then_the_window_and_padding_apply():
    """Transformers' order: (causal or same span), then the window and the padding. Rank 1 of 2 holds 2, 3, 4, 5;
    the span is tokens 3 .. 6 (across both ranks' parts); Gemma 4's spans act on sliding layers only."""
    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)
    ids = torch.tensor([[-1, -1, -1, 0, 0, 0, 0, -1]])
    spans = GatheredVisibility(8, mesh, torch.arange(8)[None], torch.tensor([[1] * 6 + [0, 1]]), TwoWaySpans(ids))
    # keys 0, 1, 6, 7, 2, 3, 4, 5: token 3 sees 0 .. 3 and its span's 4, 5 (6 is padding here)
    assert spans.mask_for(None)[0, 0, 1].tolist() == [True, True, False, False, True, True, True, True]
    assert spans.mask_for(2)[0, 0, 1].tolist() == [False] * 4 + [True] * 4  # 2, 3 and the span's later 4, 5
    assert spans.mask_for(None)[0, 0, 0].tolist() == [True, True, False, False, True, False, False, False]  # text
    sliding_only = GatheredVisibility(8, mesh, torch.arange(8)[None], None, TwoWaySpans(ids, full_layers=False))
    assert sliding_only.mask_for(None)[0, 0, 1].tolist() == [True, True, False, False, True, True, False, False]
    assert sliding_only.mask_for(4)[0, 0, 1].tolist() == [True, True, True, False, True, True, True, True]


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_torch_ring_attention_does_not_run_on_cpu(ranks):
    """What the refusal says: torch's CP SDPA has no strategy for the CPU attention kernel."""
    for rank in ranks:
        assert "_scaled_dot_product_flash_attention_for_cpu" in rank["forward"]
        assert rank["hooked"] == 1  # the one layer's attention runs causal without the model's mask


def test_each_cp_rank_holds_tokens_positions_and_their_targets_together(ranks):
    ids, labels = lm_batch(0)
    targets = next_token_targets(labels)
    seen = []
    for rank in ranks:
        positions = torch.tensor(rank["positions"])
        assert torch.equal(torch.tensor(rank["ids"]), ids.gather(1, positions))
        assert torch.equal(torch.tensor(rank["targets"]), targets.gather(1, positions))
        seen += positions[0].tolist()
    assert sorted(seen) == list(range(ids.shape[1]))  # every position once over the two ranks
    assert ranks[0]["positions"][0] == [0, 1, 2, 3, 12, 13, 14, 15]  # load-balanced: chunks 0 and 3 of 4
    assert ranks[0]["tokens"] + ranks[1]["tokens"] == ranks[0]["global_tokens"]
    assert ranks[0]["fsdp_mesh"] == ["dp_shard_cp"]


def test_split_sequence_gives_each_rank_what_torchs_region_gave_it(ranks):
    """The out-of-place split (a vision-language model's merged embeddings and positions) lays a sequence out as
    torch's context_parallel split the buffers in place on the two gloo ranks; it is differentiable and splits any
    axis (Qwen-VL's ``[3, batch, sequence]`` positions along the last)."""
    ids, _ = lm_batch(0)
    for rank, ran in enumerate(ranks):
        mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda rank=rank: rank)
        assert split_sequence(ids, mesh).tolist() == ran["ids"]
        rope = torch.arange(ids.shape[1]).expand(3, *ids.shape)
        assert split_sequence(rope, mesh, dim=2)[0].tolist() == ran["positions"]
    embeds = torch.ones(1, 16, 2, requires_grad=True)
    split_sequence(embeds, SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)).sum().backward()
    assert embeds.grad[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 8 + [0.0] * 4  # chunks 1 and 2 of 4


def test_inside_the_region_only_causal_attention_runs_the_regions_attention(monkeypatch):
    """A vision encoder's bidirectional attention keeps SDPA's own kernel; SDPA is what it was before, after."""
    calls = []
    plain = lambda *args, **kwargs: calls.append(("plain", kwargs.get("is_causal")))  # noqa: E731
    ring = lambda *args, **kwargs: calls.append(("ring", kwargs.get("is_causal")))  # noqa: E731
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", ring)
    with causal_calls_to(ring, plain):
        torch.nn.functional.scaled_dot_product_attention(1, 2, 3, is_causal=True)
        torch.nn.functional.scaled_dot_product_attention(1, 2, 3, is_causal=False)
        torch.nn.functional.scaled_dot_product_attention(1, 2, 3)
        torch.nn.functional.scaled_dot_product_attention(1, 2, 3, None, 0.0, True)
    assert calls == [("ring", True), ("plain", False), ("plain", None), ("ring", None)]
    assert torch.nn.functional.scaled_dot_product_attention is ring


def test_targets_are_the_next_tokens_labels():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 8]])
    assert next_token_targets(labels).tolist() == [[6, IGNORE_INDEX, 8, IGNORE_INDEX]]
    batch = ContextParallelBatch.from_labels(torch.tensor([[1, 2, 3, 4]]), labels)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3]]
    assert batch.label_tokens() == int((labels[:, 1:] != IGNORE_INDEX).sum()) == 2  # the engine's count
    # labels that are the next tokens already (a data set's labels_shifted) are the targets as they are
    shifted = ContextParallelBatch.from_labels(torch.tensor([[1, 2, 3, 4]]), labels, shifted=True)
    assert shifted.targets.tolist() == labels.tolist() and shifted.targets is not labels and shifted.label_tokens() == 3



def test_the_batch_keeps_its_own_positions_and_new_tensors():
    ids, labels = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 3, 4]])
    positions = torch.tensor([[0, 1, 0, 1]])
    batch = ContextParallelBatch.from_labels(ids, labels, positions)
    assert batch.position_ids.tolist() == [[0, 1, 0, 1]]
    assert batch.input_ids is not ids and batch.position_ids is not positions  # the region splits them in place


def test_left_padding_is_refused_for_ring_attention_with_what_to_do():
    """Ring attention has no mask; the all-gather attention's mask hides padding anywhere, so it takes left
    padding."""
    batch = {"input_ids": torch.tensor([[0, 5, 6, 7]]), "labels": torch.tensor([[IGNORE_INDEX, 5, 6, 7]]),
             "attention_mask": torch.tensor([[0, 1, 1, 1]])}

    def recipe(attention):
        return SimpleNamespace(cfg=SimpleNamespace(distributed=SimpleNamespace(cp_size=2, cp_attention=attention)),
                               device=torch.device("cpu"), model=None, labels_shifted=False)

    with pytest.raises(AutomodelError, match="left padding.*pad on the right.*cp_attention: all_gather"):
        NextTokenLogits.context_parallel_batch(recipe("ring"), batch)
    left = NextTokenLogits.context_parallel_batch(recipe("all_gather"), batch)
    assert left.attention_mask.tolist() == [[0, 1, 1, 1]] and left.targets.tolist() == [[5, 6, 7, IGNORE_INDEX]]
    right = {**batch, "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    assert NextTokenLogits.context_parallel_batch(recipe("ring"), right).targets.tolist() == [[5, 6, 7, IGNORE_INDEX]]


def test_attention_is_found_below_activation_checkpointing_and_runs_without_the_mask_inside_the_region():
    """Inside the region the attention modules get no mask (the region's attention has its own) and note their
    sliding window; outside (validation, generation on whole sequences) they keep the model's own mask."""
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    apply_activation_checkpointing(model)
    assert causal_attention_without_mask(model) == 2
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask", "absent")), with_kwargs=True)
    model.model.layers[1].self_attn.sliding_window = 3
    inputs = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    model(**inputs)
    assert seen[0] is not None and SplitRegion.window is None
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with SplitRegion.entered(sdpa, sdpa):
        model(**inputs)
        assert SplitRegion.window == 3  # the last layer's
    assert seen[1] is None and not SplitRegion.active


def test_eager_attention_runs_as_sdpa_inside_the_region_and_stays_eager_outside():
    """An eager model's attention inside the region goes through SDPA (whose causal calls the region's attention
    replaces; eager's own matrix products would run without any mask there) and equals the eager model on the
    whole sequence; outside, and after an error inside, the model is eager again."""
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    whole = model(input_ids=ids).logits
    assert causal_attention_without_mask(model) == 2
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal_calls = []

    def causal(*args, **kwargs):
        causal_calls.append(model.config._attn_implementation)
        return sdpa(*args, **kwargs)

    with SplitRegion.entered(causal, sdpa):
        inside = model(input_ids=ids).logits
    assert causal_calls == ["sdpa", "sdpa"]  # one per layer, each switched for its own call
    assert torch.allclose(inside, whole, atol=1e-5)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError), SplitRegion.entered(causal, sdpa):
        model(input_ids=ids, position_ids=torch.zeros(1, 3, dtype=torch.long))  # a wrong shape fails inside
    assert model.config._attn_implementation == "eager"


def test_eager_attention_with_logit_soft_capping_is_refused_with_context_parallelism():
    from transformers import Gemma2Config, Gemma3TextConfig

    assert "SDPA does not soft-cap the attention logits" in eager_issue(Gemma2Config())
    assert eager_issue(Gemma3TextConfig()) is None and eager_issue(LlamaConfig()) is None


def test_recurrent_layers_are_refused_only_under_ring_attention():
    """Mamba / linear-attention layers (``linear_attention`` in ``layer_types``: Nemotron-H's ``layers_block_type``,
    Qwen3.5's and Qwen3-Next's), Falcon-H1's Mamba beside attention (``hybrid``) and LFM2's short convolutions
    (``conv``) run along the whole sequence: the all-gather attention runs their mixers on the whole rows
    (recurrent_layers.py; trained like one process in automodel-llm's test_context_parallel.py), torch's ring
    attention cannot; RWKV / xLSTM configs name no layer types but are recurrent throughout."""
    from transformers import AutoConfig, FalconH1Config, Lfm2Config, NemotronHConfig, Qwen3_5Config, Qwen3NextConfig

    nemotron = NemotronHConfig(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"])
    assert recurrent_issue(nemotron) is None
    assert "1 of the model's layers are recurrent" in recurrent_issue(nemotron, "ring")
    qwen = Qwen3_5Config(text_config={"num_hidden_layers": 4, "full_attention_interval": 2})
    assert "2 of the model's layers are recurrent" in recurrent_issue(qwen, "ring")  # the composite's text config
    assert "cp_attention: all_gather" in recurrent_issue(Qwen3NextConfig(num_hidden_layers=4), "ring")
    assert recurrent_issue(LlamaConfig(), "ring") is None
    assert recurrent_issue(FalconH1Config(num_hidden_layers=2), "ring") is not None
    assert "2 of the model's layers" in recurrent_issue(Lfm2Config(num_hidden_layers=4, full_attn_idxs=[1, 3]), "ring")
    for model_type in ("rwkv", "xlstm"):
        assert f"the {model_type} model is recurrent" in recurrent_issue(AutoConfig.for_model(model_type))
