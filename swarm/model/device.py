"""Device and dtype selection: CUDA when present, CPU otherwise; the dtype follows what the device runs well."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def pick_device(name: str = "auto") -> torch.device:
    """Gives the device for `name` ("auto", "cpu", "cuda", "cuda:1"); auto prefers CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """Gives the compute dtype for `name`; auto is bfloat16/float16 on CUDA and float32 on CPU."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """Gives the short name of a torch dtype ("float32")."""
    return str(dtype).removeprefix("torch.")
