"""A step or a validation batch that cannot allocate stops with what to change, not a traceback; other errors pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from automodel.errors import AutomodelError
from automodel.training.out_of_memory import ran_out_of_memory, training_out_of_memory, validation_out_of_memory

CPU_ALLOC = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)")


def test_allocation_failures_are_told_apart_from_other_errors():
    assert ran_out_of_memory(CPU_ALLOC) and ran_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert not ran_out_of_memory(RuntimeError("shape mismatch")) and not ran_out_of_memory(ValueError("x"))


def test_a_training_step_out_of_memory_names_the_step_the_batch_and_the_keys_to_lower():
    with pytest.raises(AutomodelError) as info, training_out_of_memory(lambda: 3, lambda: "input_ids [1, 131072]"):
        raise CPU_ALLOC
    message = str(info.value)
    assert message.startswith("step 3 ran out of memory in its forward or backward (RuntimeError: [enforce fail")
    assert "the micro-batch is input_ids [1, 131072]" in message and "activation_checkpointing: true" in message
    with pytest.raises(RuntimeError, match="shape mismatch"), training_out_of_memory(lambda: 1, lambda: ""):
        raise RuntimeError("shape mismatch")


def test_a_validation_batch_out_of_memory_points_at_the_validation_batch_size():
    with pytest.raises(AutomodelError, match=r"validation \[squad\] at step 4 ran out of memory with batch size 8: "
                                             r"OutOfMemoryError: CUDA out of memory\. Training fit"), \
            validation_out_of_memory("squad", 4, SimpleNamespace(batch_size=8)):
        raise torch.OutOfMemoryError("CUDA out of memory.")
