"""The LoRA policy scorer: k adapters on one base model, anchors, the M-step's gradients, PEFT format."""

from __future__ import annotations

import json

import pytest
import torch
from lm_fixtures import tiny_model_dir  # noqa: F401  (fixture)
from peft import PeftModel
from stage_fixtures import write_synthetic

import moplex_core.scorers.lora_policy as lora_policy
from moplex_core.artifacts import ArtifactStore
from moplex_core.cache import load_policy_inputs, run_cache
from moplex_core.config import CacheConfig
from moplex_core.lm.loading import load_model
from moplex_core.lm.logprobs import sequence_logprobs
from moplex_core.lm.tokenize import pad_batch
from moplex_core.scorers.lora_policy import LoRAPolicyScorer, LoRASettings

SMALL = LoRASettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tmp_path_factory):  # noqa: F811
    store = ArtifactStore(tmp_path_factory.mktemp("lora-policy"))
    augmented = write_synthetic(store, n=8, m=3, n_generated=2)
    cache = run_cache(CacheConfig(model=str(tiny_model_dir)), augmented, store, progress=False)
    return load_policy_inputs(cache.path, split=None)[0]


def scorer(model_dir, **kwargs) -> LoRAPolicyScorer:
    return LoRAPolicyScorer(model_dir, 2, lora=SMALL, lr=1e-2, batch_size=4, score_batch_size=4, **kwargs)


def test_adapters_start_at_the_reference_and_the_m_step_moves_every_adapter(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2)
    torch.testing.assert_close(policy.score(inputs, 0), torch.zeros(len(inputs), 2, 5, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    before = {name: p.detach().clone() for name, p in policy._lora.items() if ".lora_B." in name}
    weights = torch.tensor([[0.9, 0.1]] * 4 + [[0.2, 0.8]] * 4, dtype=torch.float64)
    policy.fit(inputs, inputs.rankings(), weights, 0)
    for c in ("c0", "c1"):
        moved = [not torch.equal(p, before[name]) for name, p in policy._lora.items() if f".lora_B.{c}." in name]
        assert moved and all(moved), f"adapter {c} was not trained (the set_adapter requires_grad trap)"
    assert policy.exact_scores(inputs).abs().max() > 1e-3


def test_m_step_gives_non_anchor_scores_no_gradient(tiny_model_dir, inputs):  # noqa: F811
    policy = scorer(tiny_model_dir, anchors=2)
    policy.fit(inputs, inputs.rankings(), torch.full((len(inputs), 2), 0.5, dtype=torch.float64), 0)
    params = [p for name, p in policy._lora.items() if ".c1." in name]
    scores, is_anchor = policy._cluster_scores(inputs.subset([0, 1]), 1, 3, 2, train=True)  # [2, 5]
    for b in range(2):
        for j in range(5):
            grads = torch.autograd.grad(scores[b, j], params, retain_graph=True, allow_unused=True)
            norm = sum(g.abs().sum().item() for g in grads if g is not None)
            assert (norm > 0) == bool(is_anchor[b, j]), (b, j, norm)
    assert is_anchor.sum(1).tolist() == [2, 2]


def test_e_step_and_m_step_of_one_iteration_use_the_same_anchors(tiny_model_dir, inputs, monkeypatch):  # noqa: F811
    seen: dict[str, set] = {"fit": set(), "score": set()}
    phase = {"now": "fit"}
    where = {id(seq): (i, j) for i, seqs in enumerate(inputs.sequences) for j, seq in enumerate(seqs)}
    real_pass = lora_policy.anchor_pass

    def recording_pass(model, sequences, *args, **kwargs):
        seen[phase["now"]].update(where[id(seq)] for seq in sequences)
        return real_pass(model, sequences, *args, **kwargs)

    monkeypatch.setattr(lora_policy, "anchor_pass", recording_pass)
    policy = scorer(tiny_model_dir, anchors=2)
    policy.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 5)
    phase["now"] = "score"
    policy.score(inputs, 5)
    assert seen["fit"] == seen["score"]
    assert len(seen["score"]) == 2 * len(inputs)
    anchors = {(i, j) for i, j in zip(*torch.nonzero(policy.last_scores.is_anchor).T.tolist(), strict=True)}
    assert anchors == seen["score"]


def test_every_response_an_anchor_gives_the_exact_scores(tiny_model_dir, inputs):  # noqa: F811
    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    state = trained.state_dict()
    for anchors in (None, 5):
        full = scorer(tiny_model_dir, anchors=anchors)
        full.load_state_dict(state)
        torch.testing.assert_close(full.score(inputs, 1), trained.exact_scores(inputs))
        assert bool(full.last_scores.is_anchor.all())


def test_adapters_round_trip_through_peft_format(tiny_model_dir, inputs, tmp_path):  # noqa: F811
    trained = scorer(tiny_model_dir, anchors=2)
    trained.fit(inputs, inputs.rankings(), torch.ones(len(inputs), 2, dtype=torch.float64), 0)
    trained.save_adapters(tmp_path / "adapters")
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir() if p.is_dir()) == ["c0", "c1"]

    peft = PeftModel.from_pretrained(load_model(tiny_model_dir), str(tmp_path / "adapters" / "c1")).eval()
    batch = pad_batch(list(inputs.sequences[0]), trained.pad_token_id)
    with torch.no_grad():
        logp = sequence_logprobs(peft, batch.input_ids, batch.attention_mask, batch.response_mask).double()
    expected = trained.exact_scores(inputs.subset([0]))[0, 1] / trained.beta + inputs.ref_logp[0]
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)

    reloaded = scorer(tiny_model_dir, anchors=2)
    reloaded.load_adapters(tmp_path / "adapters")
    torch.testing.assert_close(reloaded.exact_scores(inputs), trained.exact_scores(inputs))


def test_saved_adapter_configs_list_their_target_modules_sorted(tiny_model_dir, tmp_path):  # noqa: F811
    # PEFT writes its target_modules set in hash-seed order; two processes saving equal adapters
    # (a killed train run and its rerun) must write equal bytes.
    targets = ("v_proj", "up_proj", "q_proj", "o_proj", "k_proj", "gate_proj", "down_proj")
    policy = LoRAPolicyScorer(tiny_model_dir, 2, lora=LoRASettings(r=2, alpha=4.0, target_modules=targets))
    policy.save_adapters(tmp_path)
    for name in ("c0", "c1"):
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["target_modules"] == sorted(targets)
