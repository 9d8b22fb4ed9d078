"""TrainRecipe: sections, the override points a domain changes, and ``setup``, which assembles the run.

``setup`` only assembles: it makes the ``BuildContext``, calls the ``build_*`` methods (by default the registered
builders), applies the pipeline and restores a checkpoint's state; builders and stages return what they build.
The loop itself is ``TrainingLoop`` (loop.py). A domain subclasses ``TrainRecipe`` and overrides what differs —
how a micro-batch becomes a summed loss (``compute_loss``), how targets are counted, the collate function, its
sections, a ``build_*`` method, which stage implementation fills a slot — never the loop.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from tqdm import tqdm

from automodel.config import Config, ConfigNode
from automodel.errors import ConfigIssue
from automodel.hf import record_run_base
from automodel.meta_build import MetaBuild, building_on_meta
from automodel.noise import debug_enabled, filter_third_party_noise
from automodel.optim.muon import muon_notes
from automodel.plugins.manager import get_plugin_manager
from automodel.recipe import BaseRecipe
from automodel.training import builders, plan
from automodel.training.checkpoint import Checkpointer, load_safetensors_dir, load_weights_into
from automodel.training.context import BuildContext
from automodel.training.dist import init_process_group, local_rank, rank, world_size
from automodel.training.host_memory import KEEP_FREED, RETURN_FREED, apply_malloc_policy
from automodel.training.inert_notes import inert_distributed_notes
from automodel.training.logging import LoggerContext, MetricLoggers, resolve_backends
from automodel.training.loop import TrainingLoop
from automodel.training.loss import chunked_loss_notes, loss_fn_issues
from automodel.training.metrics import JsonlWriter, device_peak_flops
from automodel.training.modules import is_fsdp2, trainable_parameters, unwrap
from automodel.training.multimodal_section import multimodal_issues
from automodel.training.parallel.mesh import LAYOUT_KEYS, build_device_mesh, smallest_world
from automodel.training.parallel.offload import process_group_backend
from automodel.training.parallelism import parallel_layout, run_precision, shards_with_fsdp2
from automodel.training.pipeline import PIPELINE_SLOTS, Selection, apply_pipeline, select_stages
from automodel.training.pipeline_steps import generation_issues
from automodel.training.quantized_base import base_quantization_note
from automodel.training.recipe_sections import TRAIN_SECTIONS, data_sections
from automodel.training.resume import choose_checkpoint, hold_checkpoint_dir
from automodel.training.rng import StatefulRNG, use_deterministic_algorithms
from automodel.training.stages import peft as peft_stage
from automodel.training.stages.qat import delay_fake_quantization, set_fake_quantization
from automodel.training.state import restore_states, restore_weights
from automodel.training.step_scheduler import StepScheduler, steps_per_epoch
from automodel.training.trainer_state import read_trainer_state
from automodel.v4_config import write_v4_configs

filter_third_party_noise()  # also when a recipe runs without the CLI (tests, notebooks)


class TrainRecipe(TrainingLoop, BaseRecipe):
    """Builds model, data, optimizer and schedulers from config, applies the pipeline, trains and validates."""

    domain: ClassVar[str | None] = None  # selects the builders a plugin registered for this domain
    hf_artifacts: ClassVar[tuple[str, ...]] = ("tokenizer", "processor")  # saved beside the weights in model/
    writes_diffusers_pipeline: ClassVar[bool] = False  # model/ is a diffusers pipeline (diffusers_compatible)
    # slot -> the registered implementation this recipe uses instead of the slot's default (merged like sections)
    stage_implementations: ClassVar[dict[str, str]] = {}
    # slot -> why this recipe refuses a config that asks for it (merged like sections)
    unsupported_stages: ClassVar[dict[str, str]] = {}
    # why distributed.tp_size > 1 is refused (None: the recipe's model and loss run tensor-parallel)
    tensor_parallel_unsupported: ClassVar[str | None] = (
        "this recipe's model and loss are not set up for tensor parallelism (the LLM fine-tuning recipe is); use "
        "tp_size: 1")
    # names of the model's multimodal modules (vision / audio towers, projectors: the outermost module so named),
    # which FSDP2 places by distributed.multimodal.frozen_sharding; empty: the models have none (the key is refused)
    multimodal_module_names: ClassVar[tuple[str, ...]] = ()
    stateful = ("model", "optimizer", "lr_scheduler", "step_scheduler", "dataloader", "rng", "grad_scaler")

    sections = dict(TRAIN_SECTIONS)

    # ---- validation and plan (classmethods: they run before anything is built) -------------------------------

    @classmethod
    def own_world(cls, data: dict, nodes: int = 1) -> tuple[int, int]:
        """The fewest processes ``distributed.*`` describes (``mesh.smallest_world``), split over ``nodes``."""
        settings = data.get("distributed")
        sizes = {key: settings[key] for key in LAYOUT_KEYS if key in settings} if isinstance(settings, dict) else {}
        return smallest_world(**sizes, nodes=nodes), nodes

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg)) + plan.engine_issues(cls, cfg, get_plugin_manager())
        issues += loss_fn_issues(cfg) + builders.loader_type_issues(cfg, cls.reads_loader_datasets)
        for key, why in (("tp_size", cls.tensor_parallel_unsupported), ("pp_size", cls.pipeline_parallel_unsupported),
                         ("cp_size", cls.context_parallel_unsupported)):
            size = getattr(cfg.distributed, key) if cfg.distributed is not None else 1
            if size > 1 and why:
                issues.append(ConfigIssue(f"distributed.{key}", f"{size}: {why}"))
        issues += multimodal_issues(cfg, cls.multimodal_module_names) + generation_issues(cfg)
        if cls.save_model is not None and cfg.checkpoint is not None \
                and not (cls.lora_model_is_adapter and cfg.peft is not None):  # a note then (checkpoint_notes)
            issues += cfg.checkpoint.no_sharded_form_issues(f"{cls.__name__} writes model/ in a layout of its own")
        return issues

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        return plan.plan_lines(cls, cfg, get_plugin_manager())

    @classmethod
    def pipeline_selection(cls, cfg: Config) -> Selection:
        """slot -> (implementation, config key that asked for it), for the stages that act for ``cfg``."""
        return select_stages(cfg, cls.merged("stage_implementations"), cls.merged("unsupported_stages"))

    # ---- what a domain overrides: the loss and the data ----------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The micro-batch's loss *summed* over its label tokens (the loop divides by the step's count)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(model, batch)")

    def count_label_tokens(self, batch: Any) -> int | float:
        """How many targets ``compute_loss`` sums over (samples by default; a float: the weights of weighted ones)."""
        first = next(iter(batch.values())) if isinstance(batch, dict) else batch
        return len(first)

    def count_input_tokens(self, batch: Any) -> int:
        """Tokens processed, for tokens/s (defaults to the label count)."""
        return self.count_label_tokens(batch)

    def default_collate_fn(self, train: bool = True) -> Any:
        return None  # torch's default collate

    def data_sections(self) -> dict[str, ConfigNode]:
        """The data set sections to build: ``dataset`` and each ``validation_dataset*`` the config gives (a domain
        may read one elsewhere: retrieval takes upstream's legacy ``dataloader.dataset``)."""
        return data_sections(self.cfg)

    def dataset_runtime_args(self, node: ConfigNode) -> dict[str, Any]:
        """Arguments the recipe gives the data set section ``node``'s target (a tokenizer, say), if it accepts them."""
        return {}

    def collate_runtime_args(self) -> dict[str, Any]:
        """What a collator class a ``collate_fn`` node names gets by parameter name besides its keys (upstream gives
        its collators the tokenizer; the VLM recipe its ``processor``); called after ``setup_domain``."""
        return {}

    def setup_domain(self) -> None:
        """Build what the domain needs before the model (a tokenizer, say)."""

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        return {}

    def after_step(self, step: int, tokens: int, seconds: float) -> None:
        """Called after every optimizer step with its input tokens and wall time (benchmarks use it)."""

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        if final_checkpoint is not None:
            self.log(f"final checkpoint: {final_checkpoint}")

    # ---- what a domain overrides: building (by default the builders registered for its domain) ----------------

    def build_model(self, ctx: BuildContext) -> torch.nn.Module:
        return ctx.build("model")

    def build_dataset(self, ctx: BuildContext, node: ConfigNode) -> Any:
        return builders.build_dataset(ctx, node, self.dataset_runtime_args(node))

    def build_dataloader(self, ctx: BuildContext, dataset: Any, node: ConfigNode, train: bool) -> Any:
        return ctx.build("dataloader", dataset, node, train, self.default_collate_fn(train))

    def build_loss_fn(self, ctx: BuildContext) -> torch.nn.Module:
        return ctx.build("loss_fn")

    def build_optimizer(self, ctx: BuildContext, model: torch.nn.Module) -> torch.optim.Optimizer:
        return ctx.build("optimizer", model)

    def build_lr_scheduler(self, ctx: BuildContext, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        return ctx.build("lr_scheduler", optimizer, total_steps)

    def build_step_scheduler(self, ctx: BuildContext, steps_per_epoch: int | None) -> StepScheduler:
        return ctx.build("step_scheduler", steps_per_epoch)

    def build_checkpoint_config(self, ctx: BuildContext) -> Checkpointer:
        return ctx.build("checkpoint_config").naming(type(self), "recipe" in self.cfg.raw)

    def select_device(self) -> torch.device:
        return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")

    # ---- weights ------------------------------------------------------------------------------------------------
    # The engine writes model/ in the Hugging Face layout from every rank's shards (checkpoint_write.py). A recipe
    # whose weights are something else (a diffusers pipeline, a bi-encoder) defines ``save_model(self, directory,
    # state_dict)``, given the whole weights (``state_dict``; None when every rank holds them), which writes model/
    # on rank 0; ``load_model_weights`` reads that layout back on resume.
    save_model: ClassVar[Callable[[Path, dict[str, torch.Tensor] | None], None] | None] = None
    # True where that layout, for a LoRA run (``peft:``), is the adapter alone (diffusers' LoRA file)
    lora_model_is_adapter: ClassVar[bool] = False
    reads_loader_datasets: ClassVar[bool] = False  # True: data_sections() reads upstream's dataloader.dataset

    def writes_own_layout(self) -> bool:
        return self.save_model is not None

    def save_artifacts(self, directory: Path) -> None:
        """Beside model/'s weights (rank 0): tokenizer / processor files, a LoRA adapter's base, the v4 configs."""
        for name in self.hf_artifacts:
            artifact = getattr(self, name, None)
            if artifact is not None and hasattr(artifact, "save_pretrained"):
                artifact.save_pretrained(str(directory))
        record_run_base(directory, self.cfg.model)
        if self.cfg.checkpoint.v4_compatible:
            write_v4_configs(directory, self.cfg.model)

    def load_model_weights(self, model: torch.nn.Module, directory: Path) -> None:
        """Read a model/ that ``save_model`` wrote (the checkpoint stage calls it before sharding)."""
        load_weights_into(unwrap(model), load_safetensors_dir(directory), directory)

    # ---- assembly ----------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main_process(self) -> bool:
        return rank() == 0

    @property
    def forwards_are_collective(self) -> bool:
        """Whether a forward needs every rank (FSDP2 gathers the sharded weights): then anything that runs one —
        validation, end-of-run generation — runs on every rank, and rank 0 reports."""
        return self.world_size > 1 and (is_fsdp2(self.model) or self.ctx.mesh.tp > 1)

    def log(self, message: str) -> None:
        if self.is_main_process:
            tqdm.write(message, file=sys.stderr)

    def debug(self, message: str) -> None:
        """An internal tuning line, shown only with ``AUTOMODEL_DEBUG=1``."""
        if debug_enabled():
            self.log(message)

    def process_group_store(self) -> Any:
        """The store the ranks of this run form torch's default group through: None, the rendezvous of
        ``dist_env.init_method`` (a recipe whose run holds ranks of another kind keeps its own group apart)."""
        return None

    def build_context(self) -> BuildContext:
        """What builders and stages see; the process group is joined first (the device depends on it), then the
        device mesh is built and the precision resolved (both validated with the config)."""
        cfg = self.cfg
        env = cfg.dist_env
        init_process_group(process_group_backend(cfg), env.timeout_minutes, self.log, env.init_method,
                           self.process_group_store())
        rendezvous = [f"{k}={getattr(env, k)}" for k in ("master_addr", "master_port", "init_method")
                      if getattr(env, k) is not None]
        if rendezvous and world_size() == 1:
            self.log(f"note: dist_env {', '.join(rendezvous)}: the rendezvous of a multi-process run "
                     "(--nproc-per-node N, torchrun); this run is one process")
        device, world = self.select_device(), world_size()
        sharding = self.pipeline_selection(cfg).get("sharding", (None, ""))[0]
        fsdp2 = shards_with_fsdp2(cfg, sharding, world)
        layout = parallel_layout(cfg, world)
        return BuildContext(cfg=cfg, sections=self.all_sections(), plugins=get_plugin_manager(), domain=self.domain,
                            device=device, rank=rank(), world_size=world, seed=cfg.rng.seed,
                            batch=plan.batch_layout(cfg)[0], log=self.log, load_model_weights=self.load_model_weights,
                            mesh=layout, device_mesh=build_device_mesh(layout, device.type) if world > 1 else None,
                            precision=run_precision(cfg, device, fsdp2)[0], fsdp2=fsdp2,
                            multimodal_names=self.multimodal_module_names)

    def setup(self) -> None:
        cfg = self.cfg
        self.ctx = ctx = self.build_context()
        policy = RETURN_FREED if ctx.fsdp2 else KEEP_FREED
        if ctx.device.type == "cpu" and cfg.dist_env.cpu_malloc_tuning and apply_malloc_policy(policy):
            self.debug(f"host memory: {policy.describe()} (dist_env.cpu_malloc_tuning)")
        self.rng = StatefulRNG(cfg.rng.seed, cfg.rng.ranked, ctx.mesh.seed_offset(ctx.rank))
        if cfg.rng.deterministic:
            use_deterministic_algorithms()
            self.log("rng.deterministic: torch runs deterministic algorithms only (torch.use_deterministic_algorithms)")
        self.checkpointer = self.build_checkpoint_config(ctx)
        hold_checkpoint_dir(self.checkpointer, ctx)
        try:
            self.assemble(ctx)
        except BaseException:
            self.checkpointer.release()
            raise

    def assemble(self, ctx: BuildContext) -> None:
        """Build everything (the checkpoint directory is held): model and pipeline, optimizer, data, schedulers,
        then the state of the checkpoint being resumed."""
        cfg = self.cfg
        # resolved (and its trainer_state.json checked) before anything is built: a bad checkpoint fails fast
        self.ctx = ctx = replace(ctx, restore_path=choose_checkpoint(cfg, self.checkpointer, self.log))
        self.setup_domain()
        self.checkpoint_notes()
        for note in (inert_distributed_notes(cfg, ctx.fsdp2) + chunked_loss_notes(cfg) + peft_stage.notes(cfg)
                     + muon_notes(cfg.get("optimizer"))):
            self.log(note)
        self.ctx = ctx = replace(ctx, collate_args=self.collate_runtime_args())
        with self.rng.same_on_every_rank():  # fresh tensors of a pretrained build (a new head, LoRA's) rank-alike
            with building_on_meta() as meta:
                model = self.build_model(ctx)
            if note := base_quantization_note(self.cfg.checkpoint.dequantize_base_checkpoint, model):
                self.log(note)
            self.ctx = ctx = self.after_model_built(ctx, model, meta)
            self.model = apply_pipeline(ctx, model, self.runtime_selection(ctx))
        self.pipelines = self.build_pipelines(ctx)
        self.grad_scaler = ctx.precision.grad_scaler(ctx.device.type, self.storage_dtype, ctx.fsdp2)
        self.loss_fn = self.build_loss_fn(ctx)
        self.optimizer = self.build_optimizer(ctx, self.model)
        data = self.data_sections()
        self.train_dataset = self.build_dataset(ctx, data.pop("dataset", None))
        self.dataloader = self.build_dataloader(ctx, self.train_dataset, ctx.section("dataloader"), True)
        self.val_dataloaders = {
            name.removeprefix("validation_dataset_") if name != "validation_dataset" else "validation":
                self.build_dataloader(ctx, self.build_dataset(ctx, node), ctx.section("validation_dataloader"), False)
            for name, node in data.items()}
        per_epoch = steps_per_epoch(len(self.dataloader), ctx.batch.grad_accumulation_steps) \
            if hasattr(self.dataloader, "__len__") else None
        self.step_scheduler = self.build_step_scheduler(ctx, per_epoch)
        self.lr_scheduler = self.build_lr_scheduler(ctx, self.optimizer, self.step_scheduler.total_steps)
        self.trainable_params = trainable_parameters(self.model)
        self.step_losses: list[float] = []
        self.skipped_steps = 0
        self.checkpoint_in_flight = None
        if ctx.restore_path is not None:
            restored = read_trainer_state(ctx.restore_path)
            restore_weights(ctx.restore_path, self.model, restored)
            restore_states(ctx.restore_path, self.model, self.stateful_attributes(), ctx.rank, ctx.world_size,
                           self.log, ctx.mesh.dp)
            self.step_losses = [math.nan if v is None else v for v in restored["losses"]]
            self.skipped_steps = restored["skipped_steps"]
        self.fake_quant_from = delay_fake_quantization(cfg, self.model, self.step_scheduler.step, self.log)
        self.open_metric_files()

    def train_step(self, batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Turns fake quantisation on first when ``qat.fake_quant_after_n_steps`` ends with this step."""
        if self.fake_quant_from is not None and self.step_scheduler.step >= self.fake_quant_from:
            set_fake_quantization(self.model, True)
            self.fake_quant_from = None
            self.log(f"QAT: fake quantisation on from step {self.step_scheduler.step + 1}")
        return super().train_step(batches)

    def runtime_selection(self, ctx: BuildContext) -> Selection:
        """The configured stages, with slot ``checkpoint`` acting exactly when a checkpoint is resumed (also one
        found in checkpoint_dir without restore_from, and not for ``latest`` before the first checkpoint)."""
        selection = dict(self.pipeline_selection(self.cfg))
        configured = selection.pop("checkpoint", None)
        if ctx.restore_path is not None and "checkpoint" not in self.merged("unsupported_stages"):
            selection["checkpoint"] = configured or (
                self.merged("stage_implementations").get("checkpoint", "restore"), "restore_from.path")
        return {slot: selection[slot] for slot in PIPELINE_SLOTS if slot in selection}

    def after_model_built(self, ctx: BuildContext, model: torch.nn.Module, meta: MetaBuild) -> BuildContext:
        """Log how the model was built and its precision; the context then carries the meta-device build."""
        floats = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
        self.storage_dtype = max(set(floats), key=floats.count) if floats else torch.float32
        if meta.built:
            source = f"the weights in {meta.weights}" if meta.weights else "a seeded module-by-module initialisation"
            self.log(f"model: built on the meta device by {meta.factory}; each rank materialises "
                     f"{'only its shards' if ctx.fsdp2 else 'it'} from {source}")
        elif ctx.fsdp2:
            why = meta.declined or (f"{ctx.cfg.model.target} does not build on the meta device (automodel_llm / "
                                    "automodel_vlm model factories do)")
            self.log(f"model: every rank builds the whole model before FSDP2 shards it: {why}")
        self.log(ctx.precision.describe(self.storage_dtype, ctx.fsdp2))
        return replace(ctx, meta_build=meta if meta.built else None)

    def checkpoint_notes(self) -> None:
        """``save_consolidated: final`` for a recipe whose model/ is a layout of its own (no sharded form: every
        checkpoint holds model/); ``false`` where that model/ is a LoRA adapter (nothing to consolidate)."""
        if self.writes_own_layout() and self.cfg.checkpoint.consolidated() == "final":
            self.log(f"note: checkpoint.save_consolidated: final: {type(self).__name__} writes model/ in a layout of "
                     "its own, with no sharded form, so every checkpoint holds model/, the last one too")
        asked = self.cfg.checkpoint.sharded_only_setting()
        if self.lora_model_is_adapter and self.cfg.peft is not None and asked is not None:
            self.log(f"note: {asked[0]}: {asked[1]} governs nothing in this LoRA run: model/ holds the adapter alone "
                     "(safetensors), with no consolidated form to leave out (upstream saves it so whatever it says)")

    def open_metric_files(self) -> None:
        """training.jsonl / validation.jsonl and the metric backends (rank 0 only; they start with training)."""
        root = Path(self.cfg.checkpoint.checkpoint_dir)
        keep = self.step_scheduler.step if self.ctx.restore_path is not None else -1  # records past it are redone
        self.train_log = JsonlWriter(root / "training.jsonl", keep)
        self.val_log = JsonlWriter(root / "validation.jsonl", keep)
        self.peak_flops = device_peak_flops(self.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        specs = resolve_backends(self.cfg, self.ctx.plugins.loggers)[0] if self.is_main_process else []
        if self.cfg.step_scheduler.log_remote_every_steps is not None and not specs:
            self.log("note: step_scheduler.log_remote_every_steps governs nothing this run: every metric backend "
                     "is turned off")
        self.metric_loggers = MetricLoggers(specs, LoggerContext(root, f"{type(self).__module__}."
                                                                    f"{type(self).__qualname__}", self.log))
