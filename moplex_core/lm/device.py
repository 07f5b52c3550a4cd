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

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: a CPU tensor goes to a GPU through pinned memory without a
    synchronisation; every other move is ``tensor.to(device)``. The copy reads a pinned duplicate,
    which torch's caching host allocator keeps until the copy has finished, so ``tensor`` may change
    at once; a ``tensor`` already pinned is read in place, and must not change until the device has
    used the copy. A non-contiguous tensor (a column of a table) is made contiguous first: torch
    copies a strided one through a pageable temporary, which would wait after all."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)


PASSES_PER_COPY = 64
"""Results added to `HostCopies` (a pass's, or an example's part of one) that wait on the device before
one copy brings them to the host."""


class HostCopies:
    """The small results of many passes, brought to the host together. Copying a pass's results to the
    CPU as it ends would make the host wait for the GPU after every pass, so that it could not queue
    the next one while the GPU runs this one. ``add`` keeps a tuple of tensors (None allowed) on the
    device; every `PASSES_PER_COPY` tuples, and at ``results``, one copy per device and dtype moves
    them all (tensors made on the host, an empty first entry, join those of the GPU: one ``cat`` must
    not mix the two). ``results`` gives every tuple on the CPU, in the order added."""

    def __init__(self) -> None:
        self._on_device: list[tuple[torch.Tensor | None, ...]] = []
        self._on_host: list[tuple[torch.Tensor | None, ...]] = []

    def add(self, tensors: tuple[torch.Tensor | None, ...]) -> None:
        self._on_device.append(tensors)
        if len(self._on_device) >= PASSES_PER_COPY:
            self._move()

    def results(self) -> list[tuple[torch.Tensor | None, ...]]:
        self._move()
        return self._on_host

    def _move(self) -> None:
        flat = [t for group in self._on_device for t in group if t is not None]
        host: dict[int, torch.Tensor] = {}
        for where in dict.fromkeys((t.device, t.dtype) for t in flat):
            same = [t for t in flat if (t.device, t.dtype) == where]
            moved = torch.cat([t.flatten() for t in same]).cpu().split([t.numel() for t in same])
            host.update({id(t): m.view(t.shape) for t, m in zip(same, moved, strict=True)})
        self._on_host.extend(tuple(None if t is None else host[id(t)] for t in group) for group in self._on_device)
        self._on_device.clear()


class PassOutOfMemoryError(torch.OutOfMemoryError):
    """A pass ran out of device memory; the message says which setting sizes the passes and what to
    lower. Still a ``torch.OutOfMemoryError`` (benchmarks/em_gpu.py records such a configuration as OOM)."""


@contextmanager
def passes_sized_by(setting: str) -> Iterator[None]:
    """A ``torch.OutOfMemoryError`` inside becomes a `PassOutOfMemoryError` whose message is
    ``setting`` (what sets the size of the passes, and how to lower it) and the allocator's first
    line: torch's message names no setting, and unless another process held the memory a rerun with the
    same settings runs out again (the pipeline still retries the stage once, for that case)."""
    try:
        yield
    except PassOutOfMemoryError:
        raise
    except torch.OutOfMemoryError as err:
        allocator = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
        raise PassOutOfMemoryError(f"the device ran out of memory in a pass: {setting} ({allocator})") from err
