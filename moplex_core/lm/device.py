"""Host tensors onto the model's device without making the host wait for the GPU.

A pass of the LM path builds its indices on the host (token ids, masks, where the response tokens
sit, which adapter each row uses) and copies them to the device. A plain CUDA copy from ordinary
(pageable) host memory synchronises the stream: the host stops until the GPU has finished every
kernel queued before it, so each pass would drain the queue before launching its own work. Through
pinned memory the copy is asynchronous and the host goes on launching kernels while the GPU works.
Data-dependent reads of device tensors (``.item()``, ``bool(t)``, boolean-mask indexing) wait the
same way; the passes take such decisions on the host copies instead (`moplex_core.lm.logprobs`).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: a CPU tensor goes to a GPU through pinned memory without a
    synchronisation; every other move is ``tensor.to(device)``. The copy reads a pinned duplicate,
    which torch's caching host allocator keeps until the copy has finished, so ``tensor`` may change
    at once; a ``tensor`` already pinned is read in place, and must not change until the device has
    used the copy."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
