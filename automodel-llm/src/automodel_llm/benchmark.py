"""``automodel benchmark llm``: throughput on synthetic data, warm-up excluded, written as JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel.config import Config
from automodel.config.schema import FieldErrors
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.dist import expected_node_count, expected_world_size, world_size_source
from automodel.training.metrics import device_peak_flops, peak_memory_gib
from automodel.training.modules import unwrap
from automodel_llm.datasets.pretraining import MockDataset
from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction, dataset_section


@dataclass
class BenchmarkConfig:
    warmup_steps: int = field(default=3, metadata={"help": "steps excluded from the figures"})
    seq_length: int = field(default=128, metadata={"help": "tokens per synthetic sample"})
    num_samples: int = field(default=4096, metadata={"help": "synthetic samples"})
    peak_tflops: float | None = field(default=None, metadata={"help": "device peak TFLOP/s for MFU (else known GPUs)"})
    output: str = field(default="benchmark.json", metadata={"help": "where the JSON goes",
                                                            "aliases": ("json_output_path",)})
    nsys_start: int = field(default=-1, metadata={"help": (
        "refused unless -1: upstream starts an NVIDIA Nsight Systems capture at this step (needs CUDA and nsys); "
        "profile here with torch.profiler outside the recipe")})
    nsys_end: int = field(default=-1, metadata={"help": "refused unless -1: where upstream's nsys capture stops"})
    nsys_ranks: list[int] = field(default_factory=list, metadata={"help": (
        "refused unless empty: the ranks upstream's nsys capture runs on")})
    num_nodes: int | None = field(default=None, metadata={"help": (
        "the machines the run is launched on (upstream's record of it): checked against the launch (--nnodes, "
        "torchrun's)")})

    def __post_init__(self) -> None:
        errors = {}
        for name, off in (("nsys_start", -1), ("nsys_end", -1), ("nsys_ranks", [])):
            if getattr(self, name) != off:
                errors[name] = (f"{getattr(self, name)}: an NVIDIA Nsight Systems capture needs a CUDA GPU and "
                                f"nsys, which this build does not drive; set {off} (or remove it)")
        if self.num_nodes is not None and self.num_nodes < 1:
            errors["num_nodes"] = f"must be >= 1, found {self.num_nodes}"
        if errors:
            raise FieldErrors(errors)


class BenchmarkRecipe(FinetuneRecipeForNextTokenPrediction):
    """The fine-tuning recipe on random tokens (unless a dataset is given), timing every step."""

    encoder_decoder_unsupported = ("the benchmark times causal LM steps on random token rows; an encoder-decoder "
                                   "model reads a source and a target: time its fine-tuning run instead")

    sections = {
        "benchmark": BenchmarkConfig,
        "dataset": dataset_section("training data (default: random tokens of benchmark.seq_length)"),
    }

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        """``benchmark.num_nodes`` records the launch in upstream's configs: it must be the launch's."""
        issues = list(super().check_config(cfg))
        wanted = cfg.benchmark.num_nodes if cfg.benchmark is not None else None
        nodes, world = expected_node_count(), expected_world_size()
        if wanted is not None and wanted != nodes:
            issues.append(ConfigIssue("benchmark.num_nodes", f"{wanted}, but the run is launched on {nodes} "
                                      f"node{'s' if nodes > 1 else ''} ({world_size_source()}): launch with "
                                      f"--nnodes {wanted} or set num_nodes: {nodes}"))
        elif world % nodes:
            issues.append(ConfigIssue("benchmark.num_nodes", f"{nodes}: the run's {world} processes "
                                      f"({world_size_source()}) do not split evenly over {nodes} nodes; change "
                                      "num_nodes or the parallel sizes (distributed.dp_size)"))
        return issues

    @classmethod
    def own_world(cls, data: dict, nodes: int = 1) -> tuple[int, int]:
        """Upstream's ``benchmark.num_nodes`` records the machines the benchmark is launched on: the layout is
        planned over that many."""
        bench = data.get("benchmark")
        wanted = bench.get("num_nodes") if isinstance(bench, dict) else None
        valid = isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0
        return super().own_world(data, wanted if valid else nodes)

    def setup(self) -> None:
        if "enabled" not in (self.cfg.resolved.get("checkpoint") or {}):
            self.cfg.checkpoint.enabled = False  # a benchmark measures training, not checkpoint writes
        self.step_times: list[tuple[float, int]] = []
        super().setup()

    def build_dataset(self, ctx: BuildContext, node: Any) -> Any:
        if node is not None:
            return super().build_dataset(ctx, node)
        bench = self.cfg.benchmark
        return MockDataset(num_samples=bench.num_samples, seq_length=bench.seq_length, tokenizer=self.tokenizer,
                           seed=self.cfg.rng.seed)

    def after_step(self, step: int, tokens: int, seconds: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_times.append((seconds, tokens))

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        bench = self.cfg.benchmark
        timed = self.step_times[bench.warmup_steps:] or self.step_times
        seconds = [s for s, _ in timed]
        tokens = sum(t for _, t in timed)
        tps = tokens / sum(seconds) if sum(seconds) else 0.0
        peak = bench.peak_tflops * 1e12 if bench.peak_tflops else device_peak_flops(self.device)
        params = sum(p.numel() for p in unwrap(self.model).parameters())
        result = {
            "steps_timed": len(timed), "warmup_steps": bench.warmup_steps, "tokens_per_second": tps,
            "step_time_p50": statistics.median(seconds),
            "step_time_p90": statistics.quantiles(seconds, n=10)[-1] if len(seconds) > 1 else seconds[0],
            "peak_memory_gib": peak_memory_gib(self.device), "parameters": params,
            "mfu": 6 * params * tps / peak if peak else None, "device": str(self.device),
        }
        Path(bench.output).parent.mkdir(parents=True, exist_ok=True)
        Path(bench.output).write_text(json.dumps(result, indent=2))
        for key, value in result.items():
            self.log(f"{key}: {value}")
        self.log(f"benchmark written to {bench.output}")
