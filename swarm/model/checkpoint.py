"""Read only the tensors a caller needs from a safetensors checkpoint (single file or sharded with an index)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Gives tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / filename for name, filename in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            names.update(dict.fromkeys(reader.keys(), file))
    return names


def load_tensors(
    path: Path, wanted: Iterable[str] | None = None, *, prefixes: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Gives the named tensors plus every tensor under one of `prefixes`, reading nothing else from disk."""
    files = checkpoint_files(path)
    names = set(wanted or ())
    for prefix in prefixes:
        names.update(name for name in files if name.startswith(prefix))
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt") as reader:
            for name in file_names:
                tensors[name] = reader.get_tensor(name)
    return tensors
