"""Trainer tensors brought to the host in one transfer.

A trainer keeps a pass's token ids (and lengths) on its accelerator; reading them one tensor at a time would wait
for the device once per tensor. :func:`host_sequences` joins the tensors on their device and copies them once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt


def host_sequences(sequences: Sequence[Any]) -> list[npt.NDArray[np.int64]]:
    """Each of ``sequences`` (torch tensors on any device, arrays or lists) as a flat int64 host array, the tensors
    in one transfer (per device)."""
    import torch

    out = [
        np.empty(0, np.int64) if isinstance(s, torch.Tensor) else np.asarray(s, np.int64).reshape(-1) for s in sequences
    ]
    by_device: dict[Any, list[int]] = {}
    for i, s in enumerate(sequences):
        if isinstance(s, torch.Tensor):
            by_device.setdefault(s.device, []).append(i)
    for indices in by_device.values():
        joined = torch.cat([sequences[i].detach().reshape(-1).long() for i in indices])
        parts = np.split(np.asarray(joined.cpu()), np.cumsum([sequences[i].numel() for i in indices])[:-1])
        for i, part in zip(indices, parts, strict=True):
            out[i] = part
    return out


__all__ = ["host_sequences"]
