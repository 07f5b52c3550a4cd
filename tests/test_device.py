"""Host tensors to the device and results back (moplex_core.lm.device), on the CPU."""

from __future__ import annotations

import pytest
import torch

from moplex_core.lm import device
from moplex_core.lm.device import HostCopies, to_device
from lm_fixtures import MetaReadsAsZeros


@pytest.mark.parametrize("every", [1, 2, 64])
def test_host_copies_give_every_tuple_back_in_order(monkeypatch, every):
    monkeypatch.setattr(device, "PASSES_PER_COPY", every)
    added = [(torch.arange(3, dtype=torch.float64) + g,
              None if g % 2 else torch.full((2, g + 1), g, dtype=torch.float32), torch.tensor([g]))
             for g in range(5)]  # ragged shapes, three dtypes, None in some tuples
    copies = HostCopies()
    for group in added:
        copies.add(group)
    back = copies.results()
    assert len(back) == len(added)
    for ours, theirs in zip(back, added, strict=True):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype and a.device.type == "cpu")
    assert len(copies.results()) == len(added)  # nothing left on the device, nothing added twice


def test_to_device_moves_a_cpu_tensor_as_to_does():
    t = torch.arange(6).view(2, 3)
    assert torch.equal(to_device(t, "cpu"), t) and to_device(t, "meta").device.type == "meta"


def test_host_copies_bring_back_results_made_on_the_host_beside_the_devices():
    # The E-step's first entry is made on the host (an empty split gives empty results); the passes'
    # on the model's device. One cat over both raised on a GPU; meta stands in for it here.
    copies = HostCopies()
    copies.add((torch.zeros(0, dtype=torch.float64), torch.zeros(0, 3)))
    copies.add((torch.ones(4, dtype=torch.float64, device="meta"), torch.ones(4, 3, device="meta")))
    copies.add((torch.ones(2, dtype=torch.float64), None))
    with MetaReadsAsZeros():
        back = copies.results()
    assert [[None if t is None else (tuple(t.shape), t.dtype, t.device.type) for t in group] for group in back] == [
        [((0,), torch.float64, "cpu"), ((0, 3), torch.float32, "cpu")],
        [((4,), torch.float64, "cpu"), ((4, 3), torch.float32, "cpu")],
        [((2,), torch.float64, "cpu"), None]]
    assert torch.equal(back[2][0], torch.ones(2, dtype=torch.float64))


def test_nested_pass_sizes_name_the_inner_setting_once():
    with pytest.raises(device.PassOutOfMemoryError) as raised:
        with device.passes_sized_by("outer"), device.passes_sized_by("inner setting"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    assert str(raised.value) == ("the device ran out of memory in a pass: inner setting (CUDA out of memory. Tried to "
                                 "allocate 2 GiB)")
