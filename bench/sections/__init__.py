"""One module per benchmark section; ``SECTIONS`` in the order ``bench/run.py`` runs them."""

from sections.checkpoint_io import section_checkpoint_io
from sections.cli_start import section_cli_start
from sections.config_refusal import section_config_refusal
from sections.loop_overhead import section_loop_overhead
from sections.packing import section_packing
from sections.parallel import (
    section_activation_memory,
    section_fsdp_memory,
    section_model_parallel,
    section_precision,
)
from sections.scaling import section_scaling
from sections.training import section_training, section_training_20m

SECTIONS = {"training": section_training, "loop_overhead": section_loop_overhead,
            "training_20m": section_training_20m, "cli_start": section_cli_start,
            "config_refusal": section_config_refusal, "checkpoint_io": section_checkpoint_io,
            "packing": section_packing, "scaling": section_scaling, "fsdp_memory": section_fsdp_memory,
            "activation_memory": section_activation_memory, "precision": section_precision,
            "model_parallel": section_model_parallel}
