"""RoutedAdam: k adapters stacked along dim 0 step as k separate parameters under torch's AdamW."""

from __future__ import annotations

import pytest
import torch

from moplex_core.lm.routed_adam import RoutedAdam

K = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stacked_adapters_step_as_separate_parameters_under_adamw_bit_for_bit(dtype):
    """Random gradients over 12 steps, each routing a random subset of the adapters (all of them,
    one, none of some for several steps), a learning-rate change half way (EM's backtracking) and
    a state saved and restored: parameters, moments and step counts equal AdamW's on k separate
    parameters whose unrouted ones have no gradient, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"layer.lora_A": (K, 5, 3), "layer.lora_B": (K, 3, 7)}
    stacked = {name: torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for name, shape in shapes.items()}
    separate = {(name, c): p[c].detach().clone().requires_grad_() for name, p in stacked.items() for c in range(K)}
    ours = RoutedAdam(stacked, K, lr=3e-2)
    theirs = torch.optim.AdamW(list(separate.values()), lr=3e-2, weight_decay=0.0)
    routes = [list(range(K)), [1], [0, 3], [1], list(range(K)), [2, 3], [3], [0, 1, 2], list(range(K)), [1, 2], [0], [2]]
    for step, routed in enumerate(routes):
        if step == 6:
            ours.lr = 1e-2
            for group in theirs.param_groups:
                group["lr"] = 1e-2
        if step == 8:
            saved = ours.state_dict()
            ours = RoutedAdam(stacked, K, lr=5.0)
            ours.load_state_dict(saved)
        ours.zero_grad()
        theirs.zero_grad(set_to_none=True)
        for name, p in stacked.items():
            grad = torch.randn(p.shape, generator=generator, dtype=dtype)
            grad[[c for c in range(K) if c not in routed]] = 0  # a pass's gradient at the adapters it did not route
            p.grad = grad
            for c in routed:
                separate[name, c].grad = grad[c].clone()
        ours.step(routed)
        theirs.step()
        for (name, c), p in separate.items():
            assert torch.equal(stacked[name][c], p), (step, name, c)
            if theirs.state[p]:
                assert torch.equal(ours.exp_avg[name][c], theirs.state[p]["exp_avg"]), (step, name, c)
                assert torch.equal(ours.exp_avg_sq[name][c], theirs.state[p]["exp_avg_sq"]), (step, name, c)
                assert ours.steps[c] == int(theirs.state[p]["step"])
            else:
                assert ours.steps[c] == 0


def test_unrouted_adapters_do_not_move_and_bad_calls_are_refused():
    p = torch.zeros(K, 2, 2, requires_grad=True)
    optimizer = RoutedAdam({"p": p}, K, lr=0.1)
    with pytest.raises(RuntimeError, match="no gradient, e.g. p"):
        optimizer.step([0])
    p.grad = torch.ones(K, 2, 2)  # nonzero everywhere: only the routed adapter moves anyway
    optimizer.step([2])
    assert p[2].ne(0).all() and p[[0, 1, 3]].eq(0).all()
    assert optimizer.steps == [0, 0, 1, 0]
    optimizer.step([1])  # adapter 2 unrouted now: its moments stay too
    assert p[[0, 3]].eq(0).all() and p[1].ne(0).all()
    assert optimizer.exp_avg["p"][[0, 3]].eq(0).all() and optimizer.exp_avg_sq["p"][[0, 3]].eq(0).all()
    assert torch.equal(optimizer.exp_avg_sq["p"][2], optimizer.exp_avg_sq["p"][1])  # one step each
    assert optimizer.steps == [0, 1, 1, 0]
    optimizer.step([])  # no adapter routed: nothing changes
    assert optimizer.steps == [0, 1, 1, 0]
    with pytest.raises(ValueError, match=r"adapters must be in 0..3"):
        optimizer.step([4])
    with pytest.raises(ValueError, match="stack k = 3 adapters along dim 0"):
        RoutedAdam({"p": p}, 3, lr=0.1)
    with pytest.raises(ValueError, match="not RoutedAdam's"):
        RoutedAdam({"p": p}, K, lr=0.1).load_state_dict({"state": {}, "param_groups": []})  # torch's AdamW's
    saved = optimizer.state_dict()
    q = torch.zeros(K, 3, requires_grad=True)
    with pytest.raises(ValueError, match="exp_avg covers other parameters"):
        RoutedAdam({"p": p, "q": q}, K, lr=0.1).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"exp_avg of p has shape \(4, 2, 2\), the parameter \(4, 3\)"):
        RoutedAdam({"p": q}, K, lr=0.1).load_state_dict(saved)
