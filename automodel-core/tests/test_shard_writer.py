"""The streaming DCP writer: the same files as torch's HuggingFaceStorageWriter, without its in-memory copy."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from automodel.training.parallel.shard_writer import StreamingShardWriter
from automodel.training.parallel.writer import single_process_is_intended


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"model.w": torch.randn(4, 5), "model.half": torch.randn(3, 7).to(torch.bfloat16),
            "optim.step": torch.tensor(7, dtype=torch.int64),
            "model.empty": torch.zeros(0, 3), "optim.mask": torch.tensor([True, False, True])}


def _save(writer_class: type, directory: Path, state: dict[str, torch.Tensor]) -> None:
    mapping = {key: 1 if key.startswith("model.") else 2 for key in state}
    writer = writer_class(str(directory), fqn_to_index_mapping=mapping, save_distributed=True)
    with single_process_is_intended():
        dcp.save(state, storage_writer=writer, no_dist=True)


def test_files_equal_torchs_writer(tmp_path: Path) -> None:
    state = _state()
    _save(HuggingFaceStorageWriter, tmp_path / "torch", state)
    _save(StreamingShardWriter, tmp_path / "streamed", state)
    names = sorted(p.name for p in (tmp_path / "torch").glob("*.safetensors"))
    assert names and names == sorted(p.name for p in (tmp_path / "streamed").glob("*.safetensors"))
    for name in names:
        with safe_open(tmp_path / "torch" / name, "pt") as want, safe_open(tmp_path / "streamed" / name, "pt") as got:
            assert got.metadata() == want.metadata()
            assert sorted(got.keys()) == sorted(want.keys())
            for key in want.keys():
                a, b = want.get_tensor(key), got.get_tensor(key)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key


def test_dcp_reads_what_it_wrote_back(tmp_path: Path) -> None:
    state = _state()
    _save(StreamingShardWriter, tmp_path, state)
    loaded = {key: torch.zeros_like(t) if t.dim() else torch.tensor(0, dtype=t.dtype) for key, t in state.items()}
    with single_process_is_intended():
        dcp.load(loaded, storage_reader=HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_save_holds_no_copy_of_the_state(tmp_path: Path) -> None:
    """256 MiB of tensors saved in one file: the process's peak grows by far less than the file (torch's own
    writer holds two copies of it: ~512 MiB more)."""
    script = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from automodel.training.parallel.sharded_checkpoint import write_sharded_tensors

        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        state = {{f"optim.t{{i}}": torch.full((8, 1024, 1024), float(i)) for i in range(8)}}
        before = hwm()
        write_sharded_tensors(Path({str(tmp_path)!r}), state, {{k: t.nbytes for k, t in state.items()}})
        print(hwm() - before)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    growth = float(done.stdout.strip().splitlines()[-1])
    assert growth < 64, f"the save raised the peak by {growth:.0f} MiB for a 256 MiB state"
    with safe_open(next(tmp_path.glob("*.safetensors")), "pt") as saved:
        assert saved.get_tensor("optim.t5").eq(5).all()
