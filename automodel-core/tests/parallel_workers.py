"""Scenarios that the distributed tests run on N gloo ranks (``parallel_testing.launch``), and the model and
training helpers they share with the single-process side of each comparison.

Run as ``python parallel_workers.py <scenario> <json args> <result file>`` (``{rank}`` in the file name is the
rank's); RANK / WORLD_SIZE come from the environment (absent: one process without a process group), or from
torchrun. ``AUTOMODEL_TEST_DEVICE=cuda`` runs on the GPUs with nccl (scripts/gpu_check.sh); the default is CPU
with gloo.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.optim import Muon
from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing
from automodel.training.parallel.fsdp import apply_fsdp2
from automodel.training.parallel.hf_export import export_hf
from automodel.training.parallel.materialize import materialize, parameters_on_meta
from automodel.training.parallel.mesh import build_device_mesh, data_parallel_mesh, plan_mesh
from automodel.training.parallel.precision import resolve_precision
from automodel.training.parallel.sharded_checkpoint import load_sharded_state, save_sharded_state

VOCAB, SEQ, GLOBAL_BATCH = 97, 16, 4  # an odd vocabulary: FSDP2's uneven (padded) shards


def device() -> torch.device:
    if os.environ.get("AUTOMODEL_TEST_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def tiny_config(tied: bool = True, layers: int = 3, hidden: int = 32, intermediate: int = 64, vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=tied)


def lora_config(dora: bool = False):
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                           use_dora=dora)


def meta_model(config, lora: bool | str = False, checkpointing: bool = False) -> torch.nn.Module:
    """The model built on the meta device, LoRA (``lora="dora"``: DoRA) and activation checkpointing applied (the
    pipeline's order)."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    if lora:
        import peft

        model = peft.get_peft_model(model, lora_config(dora=lora == "dora"))
    if checkpointing:
        assert apply_activation_checkpointing(model) == config.num_hidden_layers
    return model


def sharded_model(config, seed: int = 7, weights: str | None = None, lora: bool | str = False,
                  checkpointing: bool = False, precision: Any = None, dp_replicate: int = 1) -> torch.nn.Module:
    """``meta_model`` sharded with FSDP2 over every rank (HSDP with ``dp_replicate`` > 1), then materialised."""
    model = meta_model(config, lora, checkpointing)
    layout = plan_mesh(dist.get_world_size(), dp_replicate_size=dp_replicate)
    apply_fsdp2(model, data_parallel_mesh(build_device_mesh(layout, device().type), layout), precision)
    materialize(model, device(), seed, weights)
    return model


def local_model(config, seed: int = 7, weights: str | None = None, lora: bool | str = False,
                checkpointing: bool = False) -> torch.nn.Module:
    """The single-process path: the same meta build and the same materialisation, no sharding."""
    model = meta_model(config, lora, checkpointing)
    materialize(model, device(), seed, weights)
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.state_dict()`` gathered whole (a collective under FSDP2)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


def token_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def train(model: torch.nn.Module, steps: int, precision: Any = None, fsdp2: bool = False, first_step: int = 0,
          optimizer: torch.optim.Optimizer | None = None) -> list[float]:
    """``steps`` AdamW steps on ``token_batch``; under a process group each rank takes its rows of the batch."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    kind = device().type
    scaler = precision.grad_scaler(kind, torch.float32, fsdp2) if precision is not None else None
    autocast = precision.autocast(kind) if precision is not None and not fsdp2 else contextlib.nullcontext()
    losses = []
    for step in range(first_step, first_step + steps):
        rows = token_batch(step)[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world].to(device())
        with autocast:
            logits = model(input_ids=rows).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
    return losses


def save_tensors(state: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(file))


# ---- scenarios ------------------------------------------------------------------------------------------------


def scenario_fsdp(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """Materialisation (fresh, from files, HSDP, LoRA, DoRA) and training (fp32 with and without activation
    checkpointing, DoRA, bf16, fp16) under FSDP2; rank 0 writes the gathered weights for the parent to compare."""
    rank = dist.get_rank()
    layout = plan_mesh(dist.get_world_size(), dp_replicate_size=2)
    mesh = build_device_mesh(layout, device().type)
    result: dict[str, Any] = {"mesh": {
        "names": list(mesh.mesh_dim_names), "shape": list(mesh.shape), "coordinate": mesh.get_coordinate(),
        "layout_coordinate": list(layout.coordinates(rank).values()), "dp_size": mesh["dp"].size(),
        "dp_rank": mesh["dp"].get_local_rank(), "layout_dp_rank": layout.dp_rank(rank)}}
    hsdp = sharded_model(tiny_config(), weights=args["base"], dp_replicate=2)
    result["hsdp_placements"] = [repr(p) for p in hsdp.model.layers[0].mlp.up_proj.weight.placements]
    gathered = {
        "fresh": full_state(sharded_model(tiny_config())),
        "loaded": full_state(sharded_model(tiny_config(), weights=args["base"])),
        "hsdp": full_state(hsdp),
        "lora": full_state(sharded_model(tiny_config(), weights=args["base"], lora=True)),
        "dora": full_state(sharded_model(tiny_config(), weights=args["base"], lora="dora")),
        "dora_fresh": full_state(sharded_model(tiny_config(), lora="dora")),
    }
    if rank == 0:
        for name, state in gathered.items():
            save_tensors(state, out / f"{name}.safetensors")
    result["fp32"] = train(sharded_model(tiny_config(tied=False)), 3, fsdp2=True)
    result["dora_fp32"] = train(sharded_model(tiny_config(tied=False), lora="dora"), 3, fsdp2=True)
    result["fp32_checkpointed"] = train(sharded_model(tiny_config(tied=False), checkpointing=True), 3, fsdp2=True)
    for name in ("bf16", "fp16"):
        precision = resolve_precision({"param_dtype": name, "reduce_dtype": "fp32"}, device(), True)
        result[name] = train(sharded_model(tiny_config(tied=False), precision=precision), 3, precision, True)
    return result


def scenario_checkpoint(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """Sharded save (sync and async, full model and LoRA), HF export, and restores on this world size: of this
    run's checkpoint and of the single-process checkpoint ``args["one_process"]``."""
    rank, small = dist.get_rank(), 20_000  # small files: several per rank, written by both ranks
    config, result = tiny_config(), {}
    model = sharded_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result["steps_1_2"] = train(model, 2, fsdp2=True, optimizer=optimizer)
    save_sharded_state(out / "two", model, optimizer, max_file_bytes=small)
    export_hf(out / "two", out / "two_model", max_file_bytes=small)
    step2 = full_state(model)
    result["steps_3_4"] = train(model, 2, fsdp2=True, first_step=2, optimizer=optimizer)
    step4 = full_state(model)
    pending = save_sharded_state(out / "async", model, optimizer, max_file_bytes=small, async_save=True)
    result["step_5_during_async_save"] = train(model, 1, fsdp2=True, first_step=4, optimizer=optimizer)
    pending.wait()

    resumed = sharded_model(config, seed=99)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    load_sharded_state(out / "two", resumed, resumed_optimizer)
    result["resumed_3_4"] = train(resumed, 2, fsdp2=True, first_step=2, optimizer=resumed_optimizer)
    from_async = sharded_model(config, seed=99)
    load_sharded_state(out / "async", from_async)
    from_one = sharded_model(config, seed=99)
    one_optimizer = torch.optim.AdamW(from_one.parameters(), lr=1e-2)
    load_sharded_state(args["one_process"], from_one, one_optimizer)
    result["from_one_process_3_4"] = train(from_one, 2, fsdp2=True, first_step=2, optimizer=one_optimizer)

    lora = sharded_model(config, lora=True)
    lora_optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    train(lora, 2, fsdp2=True, optimizer=lora_optimizer)
    save_sharded_state(out / "lora", lora, lora_optimizer, max_file_bytes=small)
    export_hf(out / "lora", out / "lora_model")
    states = {"step2": step2, "step4": step4, "async_step4": full_state(from_async), "lora_step2": full_state(lora)}
    if rank == 0:
        for name, state in states.items():
            save_tensors(state, out / f"{name}.safetensors")
    return result


def memory_config():
    """About 13.4 M parameters (54 MB in fp32), none of them more than 2% of the model."""
    return tiny_config(tied=False, layers=8, hidden=384, intermediate=1024, vocab=512)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _resident_means_live() -> None:
    """glibc: every block of 64 KiB or more is its own mapping, returned to the system when freed, so resident
    memory follows the live tensors instead of what the heap kept from earlier phases."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD, fixed (no dynamic raise)
    libc.mallopt(-1, 65536)  # M_TRIM_THRESHOLD


def _peak_growth(action: Any) -> int:
    """How far this process's peak resident memory rose above its live size while ``action`` ran."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # freed heap memory back to the system: resident = live
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _status_bytes("VmRSS")
    action()
    return _status_bytes("VmHWM") - before


def _warm_up(build: Any, sharded: bool, out: Path) -> None:
    """Everything the phases run, once on a tiny model: imports and first-use caches are not the phases' growth."""
    model = build(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, 1, fsdp2=sharded, optimizer=optimizer)
    save_sharded_state(out / "warm", model, optimizer)
    export_hf(out / "warm", out / "warm_model")
    load_sharded_state(out / "warm", model, optimizer)
    full_state(model)


def scenario_memory(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """Peak memory growth of loading from HF safetensors, a sharded save with HF export, and a restore (model and
    optimizer) in this process: on each of N ranks, or in one process without a process group."""
    config, sharded = memory_config(), dist.is_initialized()
    build = sharded_model if sharded else local_model
    slices = args["model_bytes"] // 8  # files of 1/8 of the model: what a rank serialises at once stays small
    _resident_means_live()
    _warm_up(build, sharded, out)
    state: dict[str, Any] = {}
    growth = {"load": _peak_growth(lambda: state.update(model=build(config, weights=args["base"])))}
    state["optimizer"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-3)
    train(state["model"], 1, fsdp2=sharded, optimizer=state["optimizer"])

    def save() -> None:
        save_sharded_state(out / "ckpt", state["model"], state["optimizer"], max_file_bytes=slices)

    def export() -> None:
        export_hf(out / "ckpt", out / "model", max_file_bytes=slices)

    def restore() -> None:
        state["restored"] = build(config, seed=1)
        state["restored_optimizer"] = torch.optim.AdamW(state["restored"].parameters(), lr=1e-3)
        load_sharded_state(out / "ckpt", state["restored"], state["restored_optimizer"])

    growth["save"] = _peak_growth(save)
    growth["export"] = _peak_growth(export)
    growth["restore"] = _peak_growth(restore)
    if sharded:  # the control: a rank that does hold a whole copy of the model
        growth["gather"] = _peak_growth(lambda: state.update(full=full_state(state["model"])))
    return growth


def muon(model: torch.nn.Module) -> Muon:
    """Upstream's dion.Muon: Muon on the matrices (nesterov, weight decay), AdamW on the rest."""
    return Muon(model.parameters(), model=model, lr=1e-2, weight_decay=0.1, nesterov=True, scalar_lr=5e-3)


def scenario_muon(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """Muon under FSDP2 (untied: the output head in its own group): three steps, and step 3 again from the sharded
    checkpoint of step 2 into a model initialised otherwise; rank 0 writes both gathered results."""
    config = tiny_config(tied=False)
    model = sharded_model(config)
    optimizer = muon(model)
    result = {"steps_1_2": train(model, 2, fsdp2=True, optimizer=optimizer)}
    save_sharded_state(out / "step2", model, optimizer)
    result["step_3"] = train(model, 1, fsdp2=True, first_step=2, optimizer=optimizer)
    resumed = sharded_model(config, seed=99)
    resumed_optimizer = muon(resumed)
    load_sharded_state(out / "step2", resumed, resumed_optimizer)
    result["resumed_3"] = train(resumed, 1, fsdp2=True, first_step=2, optimizer=resumed_optimizer)
    states = {"step3": full_state(model), "resumed3": full_state(resumed)}
    if dist.get_rank() == 0:
        for name, state in states.items():
            save_tensors(state, out / f"{name}.safetensors")
    return result


def scenario_all(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """Every two-rank check in one launch (starting processes costs more than most checks): memory first, while
    the heap holds nothing else, then FSDP2, checkpoints and Muon. Each part writes under its own directory."""
    result = {}
    for name, scenario in (("memory", scenario_memory), ("fsdp", scenario_fsdp), ("checkpoint", scenario_checkpoint),
                           ("muon", scenario_muon)):
        (out / name).mkdir(exist_ok=True)
        result[name] = scenario(args.get(name, {}), out / name)
    return result


def scenario_smoke(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """A short run for real accelerators (scripts/gpu_check.sh): bf16 FSDP2 over every rank, a sharded save, the
    HF export and a restore, on this machine's device and backend."""
    precision = resolve_precision({"param_dtype": "bf16", "reduce_dtype": "fp32"}, device(), True)
    model = sharded_model(tiny_config(tied=False), precision=precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, 3, precision, True, optimizer=optimizer)
    save_sharded_state(out / "ckpt", model, optimizer)
    export_hf(out / "ckpt", out / "model")
    restored = sharded_model(tiny_config(tied=False), seed=1, precision=precision)
    load_sharded_state(out / "ckpt", restored, torch.optim.AdamW(restored.parameters(), lr=1e-2))
    saved, loaded = full_state(model), full_state(restored)
    return {"backend": dist.get_backend(), "world": dist.get_world_size(), "device": str(device()), "losses": losses,
            "restored_equal": all(torch.equal(saved[k], loaded[k]) for k in saved)}


def main(scenarios: dict[str, Any] | None = None) -> None:
    """Run the scenario named on the command line: ``scenario_<name>`` of ``scenarios`` (this module's)."""
    scenarios = globals() if scenarios is None else scenarios
    scenario, args, result_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        if device().type == "cuda":
            torch.cuda.set_device(device())
        dist.init_process_group("nccl" if device().type == "cuda" else "gloo")
    try:
        result = scenarios[f"scenario_{scenario}"](args, Path(result_file).parent)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(result_file.replace("{rank}", os.environ.get("RANK", "0"))).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
