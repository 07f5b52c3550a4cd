"""The batched multi-LoRA layer (DESIGN 5.5) against PEFT, the reference it must equal."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from lm_fixtures import tiny_model_dir  # noqa: F401  (fixture)
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from moplex_core.lm.loading import load_model
from moplex_core.lm.multi_lora import (PEFT_CONFIG, LoRASettings, MultiLoRA, MultiLoRALinear, _LoRALinear, _Route,
                                       target_layers)
from moplex_core.lm.routed_adam import RoutedAdam

SETTINGS = LoRASettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))
K = 3


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """A float64 MultiLoRA with nonzero adapters, saved in PEFT's format, and PEFT holding all three."""
    model = load_model(tiny_model_dir, dtype=torch.float64)
    lora = MultiLoRA(model, K, SETTINGS, seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora.named_parameters().values():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.3)
    out = tmp_path_factory.mktemp("multi-lora")
    lora.save_peft(out, [f"c{c}" for c in range(K)], str(tiny_model_dir))
    peft = PeftModel.from_pretrained(load_model(tiny_model_dir, dtype=torch.float64), str(out / "c0"),
                                     adapter_name="c0")
    for c in range(1, K):
        peft.load_adapter(str(out / f"c{c}"), adapter_name=f"c{c}")
    return model, lora, peft.eval(), out


def batch(rows: int = 6, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 60, (rows, length), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


def test_outside_a_route_the_model_is_the_base_model(tiny_model_dir):  # noqa: F811
    base = load_model(tiny_model_dir, dtype=torch.float64)
    model = copy.deepcopy(base)
    lora = MultiLoRA(model, K, SETTINGS)
    with torch.no_grad():
        for p in lora.named_parameters().values():
            p.add_(1.0)
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)


def test_fresh_adapters_start_exactly_at_the_base_model(tiny_model_dir):  # noqa: F811
    base = load_model(tiny_model_dir, dtype=torch.float64)
    model = copy.deepcopy(base)
    lora = MultiLoRA(model, K, SETTINGS, seed=5)
    assert lora.at_base()
    ids, mask = batch()
    with torch.no_grad(), lora.route([0, 1, 2, 0, 1, 2]):
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits)


def test_lora_a_starts_as_peft_initialises_it(tiny_model_dir):  # noqa: F811
    """PEFT's default: A ~ kaiming_uniform(a=sqrt(5)), U(-1/sqrt(d_in), 1/sqrt(d_in)). The range sets
    how fast B learns from zero, so a narrower draw would train otherwise than PEFT's adapters."""
    lora = MultiLoRA(load_model(tiny_model_dir, dtype=torch.float32), K, SETTINGS, seed=0)
    for name, layer in lora.layers.items():
        bound = layer.lora_A.shape[1] ** -0.5  # [k, d_in, r]
        assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > 0.9 * bound, name
        assert abs(layer.lora_A.std().item() - bound / 3**0.5) < 0.1 * bound, name  # a uniform's std


def test_a_mixed_batch_equals_peft_with_each_rows_adapter(trained):
    model, lora, peft, _ = trained
    ids, mask = batch()
    route = [2, 0, 1, 1, 2, 0]
    with torch.no_grad():
        with lora.route(route):
            ours = model(ids, attention_mask=mask).logits
        theirs = peft(input_ids=ids, attention_mask=mask, adapter_names=[f"c{c}" for c in route]).logits
        for c in range(K):  # and one adapter at a time, PEFT's ordinary path
            peft.set_adapter(f"c{c}")
            rows = [b for b, r in enumerate(route) if r == c]
            single = peft(input_ids=ids[rows], attention_mask=mask[rows]).logits
            torch.testing.assert_close(ours[rows], single, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert (ours - peft.get_base_model()(ids, attention_mask=mask).logits.detach()).abs().max() > 1e-2


def test_gpt2s_conv1d_projections_take_adapters_as_peft_does(tmp_path):
    """transformers' Conv1D stores W transposed (x W + b): the same map, and PEFT's fan_in_fan_out."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(tmp_path)
    model = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
    lora = MultiLoRA(model, K, LoRASettings(r=4, alpha=8.0, target_modules=("c_attn", "c_proj", "c_fc")), seed=1)
    with torch.no_grad():
        for param in lora.named_parameters().values():
            param.add_(0.1 * torch.randn_like(param))
    ids = torch.randint(0, 64, (K, 10))
    with torch.no_grad(), lora.route(list(range(K))):
        ours = model(ids).logits
    lora.save_peft(tmp_path / "adapters", [f"c{c}" for c in range(K)], str(tmp_path))
    assert json.loads((tmp_path / "adapters" / "c0" / PEFT_CONFIG).read_text())["fan_in_fan_out"] is True
    base = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
    peft = PeftModel.from_pretrained(base, tmp_path / "adapters" / "c0", adapter_name="c0")
    for c in range(1, K):
        peft.load_adapter(tmp_path / "adapters" / f"c{c}", adapter_name=f"c{c}")
    with torch.no_grad():
        for c in range(K):
            peft.set_adapter(f"c{c}")
            torch.testing.assert_close(ours[c:c + 1], peft(ids[c:c + 1]).logits, rtol=1e-10, atol=1e-10)
        assert (ours - peft.get_base_model()(ids).logits).abs().max() > 1e-2  # the adapters do something
    auto = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapters" / "c2", dtype=torch.float64).eval()
    with torch.no_grad():  # the adapter alone names its base model and task: one call loads both
        torch.testing.assert_close(ours[2:3], auto(ids[2:3]).logits, rtol=1e-10, atol=1e-10)


def test_a_shared_experts_flattened_positions_take_each_rows_adapter(tmp_path):
    """Qwen2-MoE's shared expert runs its MLP on the rows' positions as one matrix [B*L, d]: its
    projections take each row's adapter as PEFT's do (a mixed batch raised that the rows did not match).
    In float32: its experts' grouped matmul takes no float64."""
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    Qwen2MoeForCausalLM(config).save_pretrained(tmp_path)
    model = Qwen2MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    lora = MultiLoRA(model, K, LoRASettings(r=4, alpha=8.0), seed=1)
    assert any(".shared_expert.gate_proj" in name for name in lora.layers)
    with torch.no_grad():
        for param in lora.named_parameters().values():
            param.add_(0.1 * torch.randn_like(param))
    ids = torch.randint(0, 64, (K, 7))
    with torch.no_grad(), lora.route([2, 0, 1]):
        ours = model(ids).logits  # [K, L, V]
    lora.save_peft(tmp_path / "adapters", [f"c{c}" for c in range(K)], str(tmp_path))
    base = Qwen2MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, tmp_path / "adapters" / "c0", adapter_name="c0")
    for c in range(1, K):
        peft.load_adapter(tmp_path / "adapters" / f"c{c}", adapter_name=f"c{c}")
    with torch.no_grad():
        for row, c in enumerate([2, 0, 1]):
            peft.set_adapter(f"c{c}")
            torch.testing.assert_close(ours[row:row + 1], peft(ids[row:row + 1]).logits, rtol=1e-5, atol=1e-5)


def test_gradients_match_peft_for_inputs_and_adapter_weights(trained):
    model, lora, peft, _ = trained
    ids, mask = batch(rows=3)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with lora.route([1, 1, 1]):
        loss = model(inputs_embeds=emb, attention_mask=mask).logits.square().mean()
    q_proj = lora.layers["model.layers.0.self_attn.q_proj"]
    grads = torch.autograd.grad(loss, [emb, q_proj.lora_B])
    peft.set_adapter("c1")
    peft_emb = emb.detach().clone().requires_grad_(True)
    peft_loss = peft(inputs_embeds=peft_emb, attention_mask=mask).logits.square().mean()
    peft_b = dict(peft.named_parameters())["base_model.model.model.layers.0.self_attn.q_proj.lora_B.c1.weight"]
    peft_grads = torch.autograd.grad(peft_loss, [peft_emb, peft_b])
    torch.testing.assert_close(grads[0], peft_grads[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grads[1][1], peft_grads[1].T, rtol=1e-9, atol=1e-12)
    assert not grads[1][[0, 2]].any()  # adapters no row uses: zero (RoutedAdam does not step them)



@pytest.mark.parametrize("weight_grads", [False, True], ids=["inputs only (E-step)", "adapter weights (M-step)"])
def test_mixed_batch_gradients_equal_each_adapters_rows_alone(trained, weight_grads):
    """The mixed path stacks per row without adapter gradients and gathers the adapters present with
    them; either way the gradients equal those of each adapter's rows run as a one-adapter batch
    (the path tested against PEFT above)."""
    model, lora, _, _ = trained
    ids, mask = batch()
    route = [2, 0, 1, 1, 2, 0]
    emb = model.get_input_embeddings()(ids).detach()
    layer = lora.layers["model.layers.1.mlp.down_proj"]

    def grads(rows: list[int], adapters: list[int]) -> list[torch.Tensor]:
        inputs = emb[rows].clone().requires_grad_(True)
        with lora.requires_grad(weight_grads), lora.route(adapters):
            loss = model(inputs_embeds=inputs, attention_mask=mask[rows]).logits.square().sum()
            return list(torch.autograd.grad(loss, [inputs, layer.lora_A, layer.lora_B] if weight_grads else [inputs]))

    mixed = grads(list(range(len(route))), route)
    for c in range(K):
        rows = [b for b, r in enumerate(route) if r == c]
        alone = grads(rows, [c] * len(rows))
        torch.testing.assert_close(mixed[0][rows], alone[0], rtol=1e-10, atol=1e-12)
        if weight_grads:  # adapter c's A and B gradients come from its rows only
            torch.testing.assert_close(mixed[1][c], alone[1][c], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(mixed[2][c], alone[2][c], rtol=1e-10, atol=1e-12)
            others = [o for o in range(K) if o != c]
            assert not alone[1][others].any() and not alone[2][others].any()

def test_peft_saved_adapters_load_back_and_mismatches_are_refused(trained, tiny_model_dir):  # noqa: F811
    model, lora, _, out = trained
    again = MultiLoRA(load_model(tiny_model_dir, dtype=torch.float64), K, SETTINGS, seed=9)
    for c in range(K):
        again.load_peft(c, out / f"c{c}")
    for name, p in lora.named_parameters().items():
        torch.testing.assert_close(again.named_parameters()[name], p, rtol=0, atol=0)
    config = json.loads((out / "c0" / PEFT_CONFIG).read_text())
    assert config["target_modules"] == sorted(SETTINGS.target_modules) and config["peft_type"] == "LORA"
    other = MultiLoRA(load_model(tiny_model_dir), K, LoRASettings(r=2, target_modules=SETTINGS.target_modules))
    with pytest.raises(ValueError, match="r, lora_alpha, target_modules"):
        other.load_peft(0, out / "c0")
    with pytest.raises(FileNotFoundError, match="holds no PEFT adapter"):
        other.load_peft(0, out)
    rslora = out.parent / "rslora"
    shutil.copytree(out / "c0", rslora)
    (rslora / PEFT_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(ValueError, match=r"not a plain LoRA adapter .*use_rslora"):
        again.load_peft(0, rslora)


def test_peft_trained_adapters_load_into_the_layer(tiny_model_dir, tmp_path):  # noqa: F811
    reference = get_peft_model(load_model(tiny_model_dir, dtype=torch.float64),
                               LoraConfig(r=SETTINGS.r, lora_alpha=SETTINGS.alpha,
                                          target_modules=list(SETTINGS.target_modules)))
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    reference.save_pretrained(str(tmp_path))
    model = load_model(tiny_model_dir, dtype=torch.float64)
    lora = MultiLoRA(model, 2, SETTINGS)
    lora.load_peft(1, tmp_path)
    ids, mask = batch(rows=2)
    with torch.no_grad(), lora.route([1, 1]):
        torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                   reference(input_ids=ids, attention_mask=mask).logits, rtol=1e-10, atol=1e-10)


def test_the_base_model_is_frozen_and_only_adapters_train(tiny_model_dir):  # noqa: F811
    model = load_model(tiny_model_dir)
    lora = MultiLoRA(model, K, SETTINGS)
    adapter_ids = {id(p) for p in lora.named_parameters().values()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == len(adapter_ids) == 2 * len(lora.layers)  # A and B, each stacking the k adapters
    assert all(id(p) in adapter_ids for p in model.parameters() if p.requires_grad)
    ids, mask = batch(rows=2)
    with lora.route([0, 2]):
        model(ids, attention_mask=mask).logits.sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if id(p) not in adapter_ids)
    assert [c for c in range(K) if lora.layers["model.layers.0.mlp.down_proj"].lora_B.grad[c].any()] == [0, 2]
    with lora.requires_grad(False):
        assert not any(p.requires_grad for p in lora.named_parameters().values())
    assert all(p.requires_grad for p in lora.named_parameters().values())
    frozen = lora.layers["model.layers.0.mlp.down_proj"].lora_B
    frozen.requires_grad_(False)
    with lora.requires_grad(True), lora.requires_grad(False):  # nested: each restores what it found
        assert not frozen.requires_grad
    assert not frozen.requires_grad
    assert sum(not p.requires_grad for p in lora.named_parameters().values()) == 1


def test_dropout_falls_on_the_adapters_input_as_in_peft(tiny_model_dir, tmp_path):  # noqa: F811
    settings = LoRASettings(r=4, alpha=8.0, dropout=0.5, target_modules=("q_proj", "up_proj"))
    model = load_model(tiny_model_dir, dtype=torch.float64)
    lora = MultiLoRA(model, 1, settings, seed=1)
    assert not any(layer.dropout.training for layer in lora.layers.values())  # off until an M-step turns it on
    with torch.no_grad():
        for p in lora.named_parameters().values():
            p.normal_(0, 0.3)
    lora.save_peft(tmp_path, ["c0"], str(tiny_model_dir))
    peft = PeftModel.from_pretrained(load_model(tiny_model_dir, dtype=torch.float64), str(tmp_path / "c0"),
                                     is_trainable=True)
    model.train()
    peft.train()
    ids, mask = batch(rows=2)
    emb = model.get_input_embeddings()(ids).detach()
    ours_emb, theirs_emb = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    torch.manual_seed(7)
    with lora.route([0, 0]):
        ours = model(inputs_embeds=ours_emb, attention_mask=mask).logits
    torch.manual_seed(7)
    theirs = peft(inputs_embeds=theirs_emb, attention_mask=mask).logits
    with torch.no_grad():
        torch.manual_seed(8)
        with lora.route([0, 0]):
            other_mask = model(inputs_embeds=emb, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert (ours - other_mask).abs().max() > 1e-6  # dropout did act
    # Gradients through the dropped-out LoRA input, for the inputs and an adapter matrix.
    ours_a = lora.layers["model.layers.0.mlp.up_proj"].lora_A  # [1, d_in, r]: the one adapter
    theirs_a = dict(peft.named_parameters())["base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"]
    ours_grads = torch.autograd.grad(ours.square().mean(), [ours_emb, ours_a])
    theirs_grads = torch.autograd.grad(theirs.square().mean(), [theirs_emb, theirs_a])
    torch.testing.assert_close(ours_grads[0], theirs_grads[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours_grads[1][0], theirs_grads[1].T, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("per_row", [False, True], ids=["one adapter", "one per row"])
@pytest.mark.parametrize("dropout", [False, True], ids=["LoRA input is x", "LoRA input after dropout"])
def test_fused_lora_linear_backward_passes_gradcheck(per_row, dropout):
    """The layer's own backward (the LoRA part of dL/dx accumulated into the base part; the rows'
    adapters picked from the k stacked masters, their gradients summed back into the stacks) against
    finite differences, float64, for every input that takes a gradient, with an adapter two rows
    share and one that no row uses (its gradient exactly +0)."""
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_(grad)

    k, length, d_in, d_out, r, scaling = 4, 4, 5, 6, 2, 0.7
    routed = (2, 0, 2) if per_row else (1, 1, 1)
    route = _Route(rows=routed, present=tuple(sorted(set(routed))))
    pick = torch.tensor(routed) if per_row else routed[0]
    summing = route.to_adapters(scaling, torch.float64, torch.device("cpu")) if per_row else None
    shape = (len(routed), length, d_in) if per_row else (len(routed) * length, d_in)  # one adapter: one matrix
    x, weight, bias = draw(*shape), draw(d_out, d_in, grad=False), draw(d_out, grad=False)
    lora_input = draw(*shape) if dropout else None
    stacked_a, stacked_b = draw(k, d_in, r), draw(k, r, d_out)

    def layer(x, lora_input, stacked_a, stacked_b, weight=weight):
        return _LoRALinear.apply(x, lora_input, weight, bias, stacked_a, stacked_b, scaling, pick, summing)

    assert torch.autograd.gradcheck(layer, (x, lora_input, stacked_a, stacked_b))
    source = x if lora_input is None else lora_input
    a, b = stacked_a[pick], stacked_b[pick]  # [(B,) d_in, r], [(B,) r, d_out]
    expected = x @ weight.T + bias + scaling * torch.matmul(torch.matmul(source, a), b)
    torch.testing.assert_close(layer(x, lora_input, stacked_a, stacked_b), expected)
    grads = torch.autograd.grad(layer(x, lora_input, stacked_a, stacked_b).square().sum(), [stacked_a, stacked_b])
    unused = [c for c in range(k) if c not in routed]
    for grad in grads:
        assert (grad[unused] == 0).all() and not grad[unused].signbit().any()  # +0, as the optimizer's zeros
    with pytest.raises(RuntimeError, match="freezes the base model's weights"):
        layer(x, lora_input, stacked_a, stacked_b, weight.detach().requires_grad_(True)).sum().backward()
    with pytest.raises(RuntimeError, match="go to the stacked masters"):  # no gradient into a picked copy
        _LoRALinear.apply(x, lora_input, weight, bias, a, b, scaling)
    with pytest.raises(RuntimeError, match="first derivatives only"):  # no silently wrong second derivative
        (grad,) = torch.autograd.grad(layer(x, lora_input, stacked_a, stacked_b).square().sum(), stacked_b,
                                      create_graph=True)
        grad.square().sum().backward()


@pytest.mark.parametrize("routed", [(1, 1), (0, 1, 1)], ids=["one adapter", "mixed"])
def test_an_m_step_pass_leaves_unrouted_adapters_at_plus_zero_even_past_a_bad_row(routed):
    """Adapters no row uses get +0.0 gradients, as a scatter into zeros gave (not 0 * g from a GEMM
    over every row: -0.0, or NaN), also when a row's gradient is not finite."""
    torch.manual_seed(0)
    route = _Route(rows=routed, present=tuple(sorted(set(routed))),
                   adapters=torch.tensor(routed) if len(set(routed)) > 1 else None)
    layer = MultiLoRALinear(nn.Linear(6, 5).requires_grad_(False), 4, LoRASettings(r=2, alpha=4.0), route,
                            torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer.lora_B.normal_()
    weight = -torch.ones(len(routed), 4, 5)
    weight[-1, 0, 0] = float("inf")  # the last row (adapter 1) alone goes non-finite
    (layer(torch.randn(len(routed), 4, 6)) * weight).sum().backward()
    unrouted = [c for c in range(4) if c not in routed]
    for grad in (layer.lora_A.grad, layer.lora_B.grad):
        assert (grad[unrouted] == 0).all() and not grad[unrouted].signbit().any()


def test_bad_routes_and_targets_are_refused(tiny_model_dir):  # noqa: F811
    model = load_model(tiny_model_dir)
    lora = MultiLoRA(model, K, SETTINGS)
    ids, mask = batch(rows=2)
    with pytest.raises(ValueError, match="route needs one adapter index in 0..2"), lora.route([0, 3]):
        pass
    with pytest.raises(ValueError, match="route exactly the rows"), lora.route([0, 1, 2]):
        model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="match no linear layer"):
        MultiLoRA(load_model(tiny_model_dir), K, LoRASettings(target_modules=("nothing",)))
    with pytest.raises(ValueError, match=r"target_modules \(train.lora_targets\) \['v_porj'\] match no linear layer "
                                         r"of Qwen3ForCausalLM; its linear layers \(but the output layer\): \['down_proj', "
                                         r"'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        MultiLoRA(load_model(tiny_model_dir), K, LoRASettings(target_modules=("q_proj", "v_porj")))
    # GPT-2's projections are transformers' Conv1D, linear layers too: the defaults miss them, and the error
    # names them (on a model built on the meta device, as the pipeline checks a model before its stages run)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match=r"match no linear layer of GPT2LMHeadModel; its linear layers \(but the "
                                         r"output layer\): \['c_attn', 'c_fc', 'c_proj'\]; e.g. --set "
                                         r"train.lora_targets='\[\"c_attn\", \"c_fc\", \"c_proj\"\]'"):
        target_layers(gpt2, LoRASettings().target_modules)
    assert len(target_layers(gpt2, ("c_attn", "c_fc"))) == 2
    with torch.device("meta"):  # a mixture of experts: its experts' projections are fused parameters
        mixtral = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    with pytest.raises(ValueError, match=r"\['down_proj', 'gate_proj', 'up_proj'\] match no linear layer of "
                                         r"MixtralForCausalLM.*expert projections are fused parameters.*e.g. --set "
                                         r"train.lora_targets='\[\"k_proj\", \"o_proj\", \"q_proj\", \"v_proj\"\]'"):
        target_layers(mixtral, LoRASettings().target_modules)
    with pytest.raises(ValueError, match=r"names the output layer \(lm_head\).*cannot be routed per row"):
        MultiLoRA(load_model(tiny_model_dir), K, LoRASettings(target_modules=("q_proj", "lm_head")))
    special = load_model(tiny_model_dir)
    layer = special.model.layers[0].self_attn.q_proj
    special.model.layers[0].self_attn.q_proj = type("Linear8bit", (nn.Linear,), {})(layer.in_features,
                                                                                    layer.out_features, bias=False)
    with pytest.raises(ValueError, match=r"q_proj is a Linear8bit, not a plain torch.nn.Linear"):
        MultiLoRA(special, K, SETTINGS)
    hooked = load_model(tiny_model_dir)
    hooked.model.layers[0].mlp.gate_proj.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match=r"gate_proj is a Linear with hooks, not a plain torch.nn.Linear"):
        MultiLoRA(hooked, K, SETTINGS)
    with torch.autocast("cpu", dtype=torch.bfloat16), lora.route([0, 1]), \
            pytest.raises(RuntimeError, match="not under torch.autocast"):
        model(ids, attention_mask=mask)


def test_bf16_model_keeps_float32_adapters_and_matches_float64_closely(tiny_model_dir):  # noqa: F811
    reference = load_model(tiny_model_dir, dtype=torch.float64)
    low = load_model(tiny_model_dir, dtype=torch.bfloat16)
    ref_lora, low_lora = MultiLoRA(reference, K, SETTINGS, seed=2), MultiLoRA(low, K, SETTINGS, seed=2)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for (name, p), q in zip(ref_lora.named_parameters().items(), low_lora.named_parameters().values(), strict=True):
            value = torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.1
            p.copy_(value)
            q.copy_(value)
            assert q.dtype == torch.float32, name
    ids, mask = batch(rows=3)
    with torch.no_grad(), ref_lora.route([0, 1, 2]), low_lora.route([0, 1, 2]):
        exact = reference(ids, attention_mask=mask).logits
        approx = low(ids, attention_mask=mask).logits.double()
    assert (approx - exact).abs().max() < 0.05 * exact.abs().max()



def test_bf16_adapter_gradients_of_a_mixed_batch_are_summed_in_float32():
    """An M-step pass mixes adapters: each adapter's per-row gradients are summed into its stack (a GEMM
    with the route's matrix, `_into_stack`). In bf16 that sum must run in the float32 masters'
    precision, as a one-adapter batch's GEMM sums it."""
    def gradient(dtype: torch.dtype, routed: list[int]) -> torch.Tensor:  # adapter 0's A, float64
        base = nn.Linear(64, 64, dtype=torch.float64).requires_grad_(False)
        nn.init.normal_(base.weight, generator=torch.Generator().manual_seed(0))
        route = _Route()
        layer = MultiLoRALinear(base.to(dtype), 2, LoRASettings(r=8, alpha=16.0), route, torch.Generator())
        with torch.no_grad():
            for p in (layer.lora_A, layer.lora_B):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
        present = sorted(set(routed))
        route.rows, route.present = tuple(routed), tuple(present)
        route.adapters = torch.tensor(routed) if len(present) > 1 else None
        x = torch.randn(len(routed), 16, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        w = torch.randn(len(routed), 16, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        (layer(x.to(dtype)).double() * w).sum().backward()
        return layer.lora_A.grad[0].double()

    rows, errors = 256, {}
    for name, routed in (("one adapter", [0] * rows), ("mixed", [0] * (rows - 1) + [1])):
        exact = gradient(torch.float64, routed)
        errors[name] = ((gradient(torch.bfloat16, routed) - exact).norm() / exact.norm()).item()
    assert errors["mixed"] < 1.5 * errors["one adapter"], errors


def test_the_bf16_stack_follows_an_in_place_change_between_two_passes_without_gradients(tiny_model_dir):  # noqa: F811
    """In bf16 the stack is a copy: an adapter changed in place between two scoring passes (a restart's
    adapters loaded after another restart's last E-step) must be read at once, with no training pass
    between to drop the copy."""
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    lora = MultiLoRA(model, K, SETTINGS, seed=5)
    ids, mask = batch(rows=3)
    with torch.no_grad():
        for p in lora.named_parameters().values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
        base = model(ids, attention_mask=mask).logits
        with lora.route([0, 1, 2]):
            adapted = model(ids, attention_mask=mask).logits  # builds the stack
        for p in lora.named_parameters().values():
            p.zero_()
        with lora.route([0, 1, 2]):
            again = model(ids, attention_mask=mask).logits
    assert (adapted.float() - base.float()).abs().max() > 0
    torch.testing.assert_close(again, base, rtol=0, atol=0)  # zero adapters: the base model, bit for bit


@pytest.mark.parametrize("route", [[2, 0, 1, 1, 2, 0], [1] * 6], ids=["mixed", "one adapter"])
def test_passes_without_adapter_gradients_read_a_stack_that_follows_every_change(tiny_model_dir, tmp_path, route):  # noqa: F811
    """The E-step and scoring read the adapters from one stacked copy per layer in the activations'
    dtype (`MultiLoRALinear.frozen`), built once: it gives what a pass into the adapters' masters
    gives, bit for bit, and follows an optimizer step, a zeroing, a PEFT load, a copy of the model and
    a move to another dtype; one built under inference mode serves a later input-gradient pass."""
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    lora = MultiLoRA(model, K, SETTINGS, seed=5)
    params = lora.named_parameters()
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in params.values():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    ids, mask = batch()
    layer = next(iter(lora.layers.values()))

    def both() -> torch.Tensor:
        with lora.route(route):
            with torch.no_grad():
                stacked = model(ids, attention_mask=mask).logits  # the stacked copy
            masters = model(ids, attention_mask=mask).logits.detach()  # the float32 masters, with a graph
        torch.testing.assert_close(stacked, masters, rtol=0, atol=0)
        return stacked

    first = both()
    assert layer.frozen(torch.bfloat16)[0] is layer.frozen(torch.bfloat16)[0]  # kept while nothing changes
    optimizer = RoutedAdam(params, K, lr=1e-2)
    with lora.route(route):
        model(ids, attention_mask=mask).logits.float().square().mean().backward()
    optimizer.step(route)
    stepped = both()
    assert (stepped.float() - first.float()).abs().max() > 0
    lora.save_peft(tmp_path, [f"c{c}" for c in range(K)], str(tiny_model_dir))
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    assert (both().float() - stepped.float()).abs().max() > 0  # zero adapters: the base model
    for c in range(K):
        lora.load_peft(c, tmp_path / f"c{c}")
    torch.testing.assert_close(both(), stepped, rtol=0, atol=0)
    clone = copy.deepcopy(model)  # its parameters restart their version counters; the stack is not copied
    assert next(m for m in clone.modules() if isinstance(m, MultiLoRALinear))._frozen is None
    with torch.inference_mode(), lora.route(route):
        model(ids, attention_mask=mask)  # a stack built in inference mode ...
    with lora.requires_grad(False), lora.route([1] * len(route)):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeds, attention_mask=mask).logits.float().sum().backward()  # ... saved for a backward
    assert embeds.grad is not None
    model.to(torch.float64)
    assert layer.frozen(torch.float64)[0].dtype == torch.float64
    both()


def test_mixed_batch_adapter_gradients_are_the_same_bits_run_to_run_on_two_threads(tiny_model_dir):  # noqa: F811
    """An M-step pass of a mixed batch sums each adapter's rows into its gradient. On the CPU that sum
    must not depend on how threads interleave: indexing's backward there (an accumulating index_put)
    adds rows from both threads with atomic adds, in an order that changed the demo's adapters by up to
    4e-5 between two runs on two threads; index_select's (index_add) adds them in order."""
    model = load_model(tiny_model_dir, dtype=torch.float32)
    lora = MultiLoRA(model, K, LoRASettings(r=8, alpha=32.0), seed=0)
    with torch.no_grad():
        for p in lora.named_parameters().values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    ids, mask = batch(rows=32, length=8)  # 32 rows: [32, 192, 8] gradients, above the size torch splits over threads
    route = torch.randint(0, K, (32,), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(32, 8, model.config.vocab_size, generator=torch.Generator().manual_seed(3))
    params = list(lora.named_parameters().values())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(4):
            with lora.route(route):
                loss = (model(ids, attention_mask=mask).logits * weights).sum()
            runs.append(torch.autograd.grad(loss, params))
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        differ = [p for p, a, b in zip(lora.named_parameters(), runs[0], run) if not torch.equal(a, b)]
        assert not differ, f"{len(differ)} of {len(params)} adapter gradients differ between two runs, e.g. {differ[0]}"
