"""Reading data rows through ``datasets``: a hub name, or a local JSON/JSONL/CSV/parquet/text file or directory.

Shared by every domain (``datasets`` is imported on first use, so the core does not depend on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_rows(name_or_path: str, split: str = "train", key: str = "dataset.dataset_name",
              streaming: bool = False, name: str | None = None) -> Any:
    """A ``datasets.Dataset`` (or IterableDataset when streaming) for one split; ``name`` picks the subset
    (configuration) of a hub data set or a data set directory with several."""
    import datasets

    datasets.disable_progress_bars()  # the training progress bar is the one to watch
    path = Path(str(name_or_path))
    try:
        if path.is_file():
            builder = _BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise AutomodelError(f"{key}: '{path}' has an unsupported extension; use one of "
                                     f"{', '.join(sorted(_BUILDERS))}")
            if path.stat().st_size == 0:
                raise AutomodelError(f"{key}: '{path}' is empty")
            return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming)
        if path.is_dir():
            return datasets.load_dataset(str(path), name, split=split, streaming=streaming)
        if path.is_absolute() or str(name_or_path).startswith(("./", "../")) or path.suffix in _BUILDERS:
            raise AutomodelError(f"{key}: '{name_or_path}' does not exist")
        return datasets.load_dataset(str(name_or_path), name, split=split, streaming=streaming)
    except AutomodelError:
        raise
    except ValueError as err:
        raise AutomodelError(f"{key}: cannot read split '{split}' of '{name_or_path}': {err}") from None
    except Exception as err:  # datasets raises many types for a missing/offline hub name or a bad file
        hint = " (offline? point it at a local file or directory)" if not path.exists() else ""
        raise AutomodelError(f"{key}: cannot load '{name_or_path}'{hint}: {type(err).__name__}: {err}") from None
