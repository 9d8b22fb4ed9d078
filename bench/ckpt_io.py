"""Checkpoint IO: the engine's save/restore path against raw safetensors on the same tensors (one process).

engine save = ``CheckpointWrite`` + ``finish`` as the loop calls them (staging directory, the weights written with
``torch.distributed.checkpoint`` and streamed into the Hugging Face ``model/``, trainer_state.json, config.yaml,
fsync of the tree, atomic rename, LATEST) with no optimizer and no other state;
engine load = ``state.restore_weights`` (what a resume calls: the shapes checked from the files' headers, then
``torch.distributed.checkpoint``'s safetensors reader straight into the model's tensors).
raw save = ``safetensors.torch.save_file`` of the model's (de-duplicated) state dict to a new file, removing the
previous one (the engine also writes a new directory and, with keep_last=1, retires the previous one: overwriting
one file in place measures the filesystem's truncate path instead). Each side is timed for what its caller waits
for: the raw side's unlink runs inline, the engine deletes the retired directory on a background thread, which is
awaited *outside* the timed region (``engine_retention``, recorded) so it never overlaps the other side's timing.
raw load = ``load_file`` + the copy into the model (``load_state_dict``). ``load_file`` alone only maps the file
(tensors are read lazily on first touch), so it is recorded too (raw_load_file_only) but is not a like-for-like
baseline.
The operations alternate, their order flipped every repetition; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "baselines"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-config", required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()

    import torch
    from common import build_model, seed_everything
    from safetensors.torch import load_file, save_file

    from automodel.training.checkpoint import Checkpointer
    from automodel.training.checkpoint_write import CheckpointParts, CheckpointWrite
    from automodel.training.sections import CheckpointConfig
    from automodel.training.state import restore_weights
    from automodel.training.trainer_state import FORMAT, read_trainer_state

    seed_everything(0)
    model = build_model(args.model_config)
    target = build_model(args.model_config)  # what a resume loads into
    cpu = torch.device("cpu")

    state, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[key] = tensor.detach().contiguous()
    num_params = sum(t.numel() for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    root = Path(args.dir or tempfile.mkdtemp(prefix="automodel-bench-ckpt-"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    checkpointer = Checkpointer(CheckpointConfig(checkpoint_dir=str(root / "engine"), keep_last=1), "bench: true\n")
    checkpointer.prepare()
    raw_dir = root / "raw"
    raw_dir.mkdir()

    times: dict[str, list[float]] = {"engine_save": [], "raw_save": [], "engine_load": [], "raw_load": [],
                                     "raw_load_file_only": [], "engine_retention": []}
    latest: list[Path] = []
    raw_latest: list[Path] = []

    def engine_save(rep: int) -> None:
        # no optimizer/RNG/data states: the weights are what is compared with the raw file
        step = rep + 2  # the warm-up is rep -1: step 1
        trainer_state = {"format": FORMAT, "step": step, "epoch": 0, "losses": [], "world_size": 1,
                         "skipped_steps": 0, "step_scheduler": {"step": step, "epoch": 0, "epoch_step": step}}
        parts = CheckpointParts(model, None, {}, trainer_state, save_artifacts=lambda directory: None)
        latest[:] = [CheckpointWrite(checkpointer, parts, rank=0, device=cpu).finish()]

    def raw_save(rep: int) -> None:
        file = raw_dir / f"model-{rep + 1}.safetensors"
        save_file(state, str(file), metadata={"format": "pt"})
        for old in raw_latest:
            old.unlink()
        raw_latest[:] = [file]

    def engine_load(rep: int) -> None:
        restore_weights(latest[0], target, read_trainer_state(latest[0]))

    def raw_load(rep: int) -> None:
        target.load_state_dict(load_file(str(raw_latest[0])), strict=False)

    def raw_load_file_only(rep: int) -> None:
        assert len(load_file(str(raw_latest[0]))) == len(state)

    ops = [("engine_save", engine_save), ("raw_save", raw_save), ("engine_load", engine_load),
           ("raw_load", raw_load), ("raw_load_file_only", raw_load_file_only)]
    # warm-up: first-call costs (imports, page cache) are not what we compare
    engine_save(-1), checkpointer.wait(), raw_save(-1)
    for rep in range(args.reps):
        # saves before loads (a load reads what was just saved); within each pair the order alternates
        pairs = [ops[0:2], ops[2:4], ops[4:]]
        for pair in pairs:
            for name, fn in (pair if rep % 2 == 0 else pair[::-1]):
                start = time.perf_counter()
                fn(rep)
                times[name].append(time.perf_counter() - start)
                if name == "engine_save":
                    start = time.perf_counter()
                    checkpointer.wait()
                    times["engine_retention"].append(time.perf_counter() - start)
    with torch.no_grad():
        for tensor in target.state_dict().values():
            tensor.zero_()  # the round trip below must fill every tensor
    engine_load(args.reps)
    with torch.no_grad():
        pairs = zip(model.state_dict().values(), target.state_dict().values(), strict=True)
        same = all(torch.equal(a, b) for a, b in pairs)
    files = sorted(p.name for p in (latest[0] / "model").iterdir())
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"num_params": num_params, "bytes": nbytes, "times_s": times,
                      "median_s": {k: statistics.median(v) for k, v in times.items()},
                      "engine_files": files, "round_trip_equal": same}))


if __name__ == "__main__":
    main()
