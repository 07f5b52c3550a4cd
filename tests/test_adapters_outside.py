"""A train artifact's adapters outside moplex: read with transformers and PEFT alone, as docs/adapters.md
shows (its block runs here as written), and checked against what vLLM's LoRA loader reads
(vllm/lora/peft_helper.py, lora_model.py, utils.py; no vLLM here to load them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from moplex_core.artifacts import ArtifactStore, load_table
from stage_fixtures import tiny_trained_mixture

PAGE = Path(__file__).parents[1] / "docs" / "adapters.md"
PLACEHOLDER = "data/artifacts/train/<version>"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # vLLM's Qwen3 LoRA layers
TOLERANCE = 1e-4  # nats: float32 sums of a few dozen tokens, here and in moplex's passes


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    """(the page's block's namespace after it ran on a tiny trained mixture, the train folder, the rankings
    folder): three restarts of two EM iterations with 2 anchors of m = 3, LoRA on all seven projections and
    a step that moves the adapters apart (beta = 1, as the demo's)."""
    store = ArtifactStore(tmp_path_factory.mktemp("artifacts"))
    rankings, _, train = tiny_trained_mixture(store, em_iterations=2, train_settings={
        "lora_targets": TARGETS, "lr": 3e-3, "beta": 1.0, "first_epochs": 4, "restarts": 3, "anchors": 2})
    text = PAGE.read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index("The k policies with nothing from"):], re.S).group(1)
    assert block.count(PLACEHOLDER) == 1
    namespace: dict = {}
    exec(compile(block.replace(PLACEHOLDER, str(train)), "docs/adapters.md block", "exec"), namespace)
    return namespace, train, rankings


def test_the_pages_block_computes_every_score_em_recorded_again(consumer):
    ns, train, _ = consumer
    scores = ns["scores"]
    assert len(scores) == 18 * 3 * 3 and len(ns["exact"]) == 18 * 2 * 3  # 18 training rankings, m = 3, a = 2, k = 3
    assert ns["gap"] < TOLERANCE
    # adapters/ is the best restart's last iteration, which is not the last restart here
    restart = ns["restart"]
    last = sorted(train.glob(f"em/restart-{restart:02d}/iter-*"))[-1]
    assert restart < 2, "the fixture needs a best restart before the last to tell them apart"
    for folder in sorted((train / "adapters").iterdir()):
        saved = folder / "adapter_model.safetensors"
        assert saved.read_bytes() == (last / "adapters" / folder.name / saved.name).read_bytes()
    # the adapters are far apart, so a cluster scored under another's adapter would be off by far more
    spread = scores.groupby(["example_id", "response_idx"]).score.agg(lambda s: s.max() - s.min())
    assert spread.max() > 1000 * TOLERANCE


def test_an_adapter_alone_scores_as_it_does_among_the_others(consumer):
    ns, train, _ = consumer
    policy, logp, cache = ns["policy"], ns["logp"], ns["cache"]
    assert sorted(policy.peft_config) == ["c0", "c1", "c2"]
    cached = cache.iloc[0]
    sequences = [(ids.tolist(), start) for ids, start in zip(cached.input_ids, cached.response_start, strict=True)]
    for c in (2, 0, 1):  # set_adapter back and forth
        policy.set_adapter(f"c{c}")
        together = [logp(policy, ids, start) for ids, start in sequences]
        alone = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ns["base"]),
                                          train / "adapters" / f"c{c}")
        assert [logp(alone, ids, start) for ids, start in sequences] == pytest.approx(together, abs=TOLERANCE)


def test_a_merged_adapter_scores_and_generates_as_the_adapter(consumer):
    ns, train, _ = consumer
    policy, logp, cache = ns["policy"], ns["logp"], ns["cache"]
    # in one call: the base model at the path the adapter names, the auto class from its task_type
    merged = AutoPeftModelForCausalLM.from_pretrained(train / "adapters" / "c1").merge_and_unload()
    assert type(merged) is type(policy.get_base_model()) and not any(isinstance(m, LoraLayer) for m in merged.modules())
    policy.set_adapter("c1")
    for cached in cache.itertuples():
        for ids, start in zip(cached.input_ids, cached.response_start, strict=True):
            ids = ids.tolist()
            assert logp(merged, ids, start) == pytest.approx(logp(policy, ids, start), abs=TOLERANCE)
    prompt = torch.tensor([cache.iloc[0].input_ids[0][: cache.iloc[0].response_start[0]].tolist()])
    sampled = policy.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
    assert sampled.shape[1] > prompt.shape[1]
    assert torch.equal(merged.generate(input_ids=prompt, max_new_tokens=12, do_sample=False), sampled)


def test_the_cache_tokens_come_from_the_texts_by_the_pages_recipe(consumer):
    ns, _, rankings = consumer
    tokenizer = AutoTokenizer.from_pretrained(ns["base"])
    texts = {row["example_id"]: row for row in load_table(rankings).to_pylist()}
    for example_id, cached in ns["cache"].iterrows():
        row = texts[example_id]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
        prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        for j, response in enumerate(row["responses"]):
            ids = prompt + tokenizer(response, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            assert (cached.input_ids[j].tolist(), cached.response_start[j]) == (ids + [tokenizer.eos_token_id],
                                                                                len(prompt)), (example_id, j)


def test_the_adapter_files_are_what_vllms_lora_loader_reads(consumer):
    ns, train, _ = consumer
    base = AutoModelForCausalLM.from_pretrained(ns["base"])
    linear = {name: module for name, module in base.named_modules() if name.rsplit(".", 1)[-1] in TARGETS}
    assert linear and all(isinstance(m, torch.nn.Linear) for m in linear.values())
    trained = json.loads((train / "manifest.json").read_text())["config"]
    for folder in sorted((train / "adapters").iterdir()):
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        config = json.loads((folder / "adapter_config.json").read_text())
        r = config["r"]  # PEFTHelper's required fields: r, lora_alpha (scaling lora_alpha / r), target_modules
        assert (r, config["lora_alpha"]) == (trained["lora_r"], trained["lora_alpha"])
        assert config["target_modules"] == sorted(TARGETS) and config["base_model_name_or_path"] == ns["base"]
        # what PEFTHelper refuses, or reads as another scaling (rsLoRA, per-module patterns)
        assert config["bias"] == "none" and config["init_lora_weights"] is True
        refused = ("modules_to_save", "use_dora", "use_rslora", "lora_bias", "alora_invocation_tokens",
                   "layer_replication", "use_bdlora", "use_qalora", "rank_pattern", "alpha_pattern")
        assert not any(config.get(key) for key in refused), {key: config.get(key) for key in refused}
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as weights:
            shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
        # utils.parse_fine_tuned_lora_name: base_model.model.<module>.lora_A.weight / lora_B.weight
        expected = {}
        for name, module in linear.items():
            expected[f"base_model.model.{name}.lora_A.weight"] = (r, module.in_features)
            expected[f"base_model.model.{name}.lora_B.weight"] = (module.out_features, r)
        assert shapes == expected, folder.name
