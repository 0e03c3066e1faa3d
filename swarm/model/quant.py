"""Weight quantization of a block's linear layers with bitsandbytes (int8 LLM.int8(), nf4); runs on CPU and CUDA."""

from __future__ import annotations

import torch
from torch import nn

QUANT_MODES = ("none", "int8", "nf4")


def quantize_linears(module: nn.Module, mode: str, *, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Gives `module` with every nn.Linear replaced by its bitsandbytes counterpart (in place), moved to `device`."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    if mode == "none":
        return module.to(device)
    import bitsandbytes as bnb

    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            has_bias = child.bias is not None
            if mode == "int8":
                replacement = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=has_bias, has_fp16_weights=False, threshold=6.0
                )
            else:
                replacement = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=has_bias, quant_type="nf4", compute_dtype=compute_dtype
                )
            replacement.load_state_dict(child.state_dict())
            setattr(parent, child_name, replacement.to(device))  # bitsandbytes quantizes on this move
    return module.to(device)


def realias_moved_weights(module: nn.Module) -> None:
    """Points bitsandbytes' int8 weight alias (`CB`, read again at the first forward) at where each weight now lives.

    Needed after a quantized block's tensors moved (into pool pages): otherwise the first int8 forward would swap the
    old copy back in. The small per-row scales (`SCB`) and nf4 quantization states stay where they are.
    """
    for parameter in module.parameters():
        if getattr(parameter, "CB", None) is not None:
            parameter.CB = parameter.data
