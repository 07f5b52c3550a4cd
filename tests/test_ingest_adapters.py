"""Dataset adapters on hand-written fixtures in each raw schema (ingest as a whole: test_ingest_build)."""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from lm_fixtures import tiny_tokenizer  # noqa: F401 (session fixture)

from moplex_core.config import IngestConfig, PersonaOptions, PrismOptions, SplitConfig, UltraFeedbackOptions
from moplex_core.data import generic, helpsteer2, persona, prism, ultrafeedback
from moplex_core.data.sources import RawRejects, RawSchemaError, Record, iter_local_records
from moplex_core.hashing import short_hash
from moplex_core.ingest import build_rankings
from moplex_core.lm.tokenize import encode_prompt


def records(path: Path) -> list:
    return list(iter_local_records(path))


def by_prompt(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["prompt"], {})[r["cluster"]] = r
    return out


# --- UltraFeedback ---------------------------------------------------------------------------------


def test_ultrafeedback_ranks_each_criterion_with_ties_as_tiers(fixtures_dir):
    out = ultrafeedback.to_rankings(records(fixtures_dir / "ultrafeedback.jsonl"), UltraFeedbackOptions(),
                                    source="uf", seed=0)
    sky = by_prompt(out.rows)["Explain why the sky is blue in two sentences."]
    assert set(sky) == {"helpfulness", "honesty", "instruction_following", "truthfulness"}
    # Ratings (string "5", "2", "4", "4") -> tiers; equal ratings share a tier.
    assert sky["helpfulness"]["ranking"] == [[0], [2, 3], [1]]
    assert sky["honesty"]["ranking"] == [[0, 3], [2], [1]]
    assert sky["instruction_following"]["ranking"] == [[0], [1], [2], [3]]
    assert sky["truthfulness"]["ranking"] == [[0, 2], [3], [1]]
    assert all(r["ranked_prefix"] == len(r["ranking"]) for r in sky.values())
    assert len({tuple(r["responses"]) for r in sky.values()}) == 1  # one slate for all criteria
    assert len({r["example_id"] for r in out.rows}) == len(out.rows)


def test_ultrafeedback_traps_na_short_slates_empty_responses_duplicates_and_agreeing_criteria(fixtures_dir):
    out = ultrafeedback.to_rankings(records(fixtures_dir / "ultrafeedback.jsonl"), UltraFeedbackOptions(),
                                    source="uf", seed=0)
    prompts = by_prompt(out.rows)
    # "N/A" truthfulness inside a 4-completion prompt: that criterion gives no ranking for it.
    assert set(prompts["How many legs does a fish have?"]) == {"helpfulness", "honesty", "instruction_following"}
    # Five completions, one "N/A" for honesty: the slate is the four rated on every criterion.
    french = prompts["Translate to French: 'The library opens at nine.'"]
    assert "Bibliothèque ouvre neuf." not in french["honesty"]["responses"] and len(french) == 4
    # An empty response is not a candidate.
    assert all(t.strip() for r in prompts["Give one tip for writing clear code."].values() for t in r["responses"])
    assert "Name a prime number greater than 10." not in prompts  # 3 completions: skipped by default
    assert "Write a haiku about autumn: leaves, wind, and light." not in prompts  # one order for all
    assert out.stats == {
        "records": 7, "prompts": 4, "rankings": 15, "skipped_short_slate": 1, "criterion_not_rated": 1,
        "skipped_too_few_distinct_rankings": 1, "skipped_duplicate_record": 1,
    }


def test_ultrafeedback_options_keep_short_slates_and_require_more_distinct_orders(fixtures_dir):
    recs = records(fixtures_dir / "ultrafeedback.jsonl")
    keep = ultrafeedback.to_rankings(recs, UltraFeedbackOptions(short_slates="keep"), source="uf", seed=0)
    prime = by_prompt(keep.rows)["Name a prime number greater than 10."]
    assert {len(r["responses"]) for r in prime.values()} == {3}
    strict = ultrafeedback.to_rankings(recs, UltraFeedbackOptions(min_distinct_rankings=4), source="uf", seed=0)
    assert set(by_prompt(strict.rows)) == {"Explain why the sky is blue in two sentences."}
    allowed = ultrafeedback.to_rankings(recs, UltraFeedbackOptions(min_distinct_rankings=1), source="uf", seed=0)
    assert "Write a haiku about autumn: leaves, wind, and light." in by_prompt(allowed.rows)


def test_ultrafeedback_picks_a_seeded_slate_when_more_completions_qualify(fixtures_dir):
    recs = records(fixtures_dir / "ultrafeedback.jsonl")
    options = UltraFeedbackOptions(m=3)
    slates = {
        seed: by_prompt(ultrafeedback.to_rankings(recs, options, source="uf", seed=seed).rows)[
            "Explain why the sky is blue in two sentences."]["helpfulness"]["responses"]
        for seed in range(6)
    }
    again = by_prompt(ultrafeedback.to_rankings(recs, options, source="uf", seed=0).rows)
    assert again["Explain why the sky is blue in two sentences."]["helpfulness"]["responses"] == slates[0]
    assert len({tuple(s) for s in slates.values()}) > 1
    assert all(len(s) == 3 for s in slates.values())


def test_ultrafeedback_reads_a_repeated_response_once(fixtures_dir):
    # Two copies of one text would be ranked apart by their ratings (tiers 0 and 2 here), which no
    # scorer can learn: the first is read, and the slate of four is drawn from the others.
    record = json.loads((fixtures_dir / "ultrafeedback.jsonl").read_text().splitlines()[0])
    completions = record["completions"]
    copy = {**completions[1], "response": f"  {completions[0]['response']}\n"}
    record["completions"] = [completions[0], copy, *completions[1:]]
    out = ultrafeedback.to_rankings([Record("uf.jsonl line 1", record)], UltraFeedbackOptions(), source="uf", seed=0)
    original = ultrafeedback.to_rankings(records(fixtures_dir / "ultrafeedback.jsonl")[:1], UltraFeedbackOptions(),
                                         source="uf", seed=0)
    assert out.stats["skipped_duplicate_response"] == 1
    assert [(r["responses"], r["ranking"]) for r in out.rows] == [(r["responses"], r["ranking"]) for r in original.rows]


def test_ultrafeedback_bad_ratings_name_the_record_and_field(tmp_path, fixtures_dir):
    record = json.loads((fixtures_dir / "ultrafeedback.jsonl").read_text().splitlines()[0])
    record["completions"][2]["annotations"]["honesty"]["Rating"] = "five"
    path = tmp_path / "uf.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(RawSchemaError, match=r"uf.jsonl line 1, completion 2, honesty: Rating 'five'") as raised:
        ultrafeedback.to_rankings(records(path), UltraFeedbackOptions(), source="uf", seed=0)
    assert raised.value.field == "completions[2].annotations.honesty.Rating"  # rejected.parquet's field
    path.write_text(json.dumps({"instruction": "hi"}) + "\n")
    with pytest.raises(RawSchemaError, match=r"uf.jsonl line 1: a UltraFeedback record needs field\(s\) \['completions'\]"):
        ultrafeedback.to_rankings(records(path), UltraFeedbackOptions(), source="uf", seed=0)
    # NaN would land in no tier, infinity on top: only 1..5 and "N/A" are ratings
    for rating in ("nan", "inf", "7", "0", 6):
        record["completions"][2]["annotations"]["honesty"]["Rating"] = rating
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(RawSchemaError, match=f"completion 2, honesty: Rating {rating!r} is neither a rating in 1..5"):
            ultrafeedback.to_rankings(records(path), UltraFeedbackOptions(), source="uf", seed=0)
    record["completions"][2]["annotations"]["honesty"]["Rating"] = "4"
    for field, value, error in [("annotations", "oops", r"completion 1's 'annotations' must be an object"),
                                ("response", 3, r"completion 1's 'response' must be text, got int")]:
        broken = json.loads(json.dumps(record))
        broken["completions"][1][field] = value
        path.write_text(json.dumps(broken) + "\n")
        with pytest.raises(RawSchemaError, match=error):
            ultrafeedback.to_rankings(records(path), UltraFeedbackOptions(), source="uf", seed=0)
    broken = json.loads(json.dumps(record))
    broken["completions"][1]["annotations"]["honesty"] = "5"
    path.write_text(json.dumps(broken) + "\n")
    with pytest.raises(RawSchemaError, match=r"completion 1, honesty: the annotation must be an object with a 'Rating'"):
        ultrafeedback.to_rankings(records(path), UltraFeedbackOptions(), source="uf", seed=0)
    broken["completions"][1] = "oops"  # no object: the field is the completion, not a response it lacks
    path.write_text(json.dumps(broken) + "\n")
    with pytest.raises(RawSchemaError, match=r"completion 1 has no 'response'") as raised:
        ultrafeedback.to_rankings(records(path), UltraFeedbackOptions(), source="uf", seed=0)
    assert raised.value.field == "completions[1]"


# --- PERSONA ---------------------------------------------------------------------------------------


def test_persona_text_splits_on_the_first_colon_space_only():
    text = ("age: 34\nsex: Female\nbig five scores: Openness: High, Neuroticism: Low\n"
            "defining quirks: Says \"Note: this\"\n  and more\nHousehold Language: English only")
    assert persona.parse_persona(text) == {
        "age": "34",
        "sex": "Female",
        "big five scores": "Openness: High, Neuroticism: Low",
        "defining quirks": 'Says "Note: this"\nand more',
        "household language": "English only",
    }
    # a field with no value is a field, not the end of the one before (which made a cluster of its own)
    assert persona.parse_persona("age: 34\nsex: Female\nhousehold language:\nrace: White alone") == {
        "age": "34", "sex": "Female", "household language": "", "race": "White alone"}
    # ... but a line of a value that ends in ":" before more of that value stays in the value
    assert persona.parse_persona("quirks: Collects stamps\nHer favourites are:\nthe blue ones\nage: 3") == {
        "quirks": "Collects stamps\nHer favourites are:\nthe blue ones", "age": "3"}


def test_persona_profiles_follow_the_preset_and_skip_what_they_cannot_place():
    preset = PersonaOptions()
    label = persona.profile_label
    assert label({"age": "44", "sex": "Male", "race": "Black or African American alone"}, preset) == \
        "age=18-44|sex=Male|race=Black"
    assert label({"age": "45", "sex": "Female", "race": "Two or more races"}, preset) == "age=45+|sex=Female|race=Other"
    assert label({"age": "16", "sex": "Male", "race": "White alone"}, preset) is None  # below the first band
    assert label({"age": "30", "sex": "Male"}, preset) is None  # no race key
    custom = PersonaOptions(fields=("sex", "ideology"), top_profiles=None)
    assert label({"sex": "Male", "ideology": "Liberal", "age": "70"}, custom) == "sex=Male|ideology=Liberal"


def test_persona_rows_prefer_the_revision_in_a_seeded_position(fixtures_dir):
    out = persona.to_rankings(records(fixtures_dir / "persona.jsonl"), PersonaOptions(), source="p", seed=0)
    raw = [r.data for r in records(fixtures_dir / "persona.jsonl")]
    revised = {d["data"] for d in raw if d["data"] != d["original"]}
    for row in out.rows:
        (best,), (worst,) = row["ranking"]
        assert row["responses"][best] in revised and row["responses"][worst] not in revised
    assert {best for row in out.rows for (best,), _ in [row["ranking"]]} == {0, 1}  # both positions occur
    assert Counter(r["cluster"] for r in out.rows) == {
        "age=18-44|sex=Female|race=White": 2, "age=45+|sex=Male|race=Black": 2,
        "age=18-44|sex=Female|race=Asian": 2, "age=45+|sex=Male|race=Other": 1,
    }
    assert out.stats["skipped_empty_or_unrevised"] == 1 and out.stats["skipped_no_profile"] == 2
    top2 = persona.to_rankings(records(fixtures_dir / "persona.jsonl"), PersonaOptions(top_profiles=2),
                               source="p", seed=0)
    assert len({r["cluster"] for r in top2.rows}) == 2 and top2.stats["skipped_rare_profile"] == 3


def test_persona_reads_parquet_with_the_spaced_question_type_column(tmp_path, fixtures_dir):
    rows = [r.data for r in records(fixtures_dir / "persona.jsonl")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train-00000-of-00001.parquet")
    from_parquet = records(tmp_path)
    assert from_parquet[0].data["question type"] == "train"
    assert from_parquet[0].where.endswith("train-00000-of-00001.parquet row 0")
    a = persona.to_rankings(from_parquet, PersonaOptions(), source="p", seed=0)
    b = persona.to_rankings(records(fixtures_dir / "persona.jsonl"), PersonaOptions(), source="p", seed=0)
    assert a.rows == b.rows


# --- HelpSteer2 ------------------------------------------------------------------------------------


def test_helpsteer2_emits_one_pair_per_attribute_that_differs(fixtures_dir):
    out = helpsteer2.to_rankings(records(fixtures_dir / "helpsteer2.jsonl"), helpsteer2.HelpSteer2Options(),
                                 source="hs")
    canberra = [r for r in out.rows if r["prompt"] == "What is the capital of Australia?"]
    # Ratings [4,4,4,0,0] vs [4,4,4,1,2]: only complexity and verbosity differ, the second is higher.
    assert {(r["cluster"], tuple(map(tuple, r["ranking"]))) for r in canberra} == {
        ("complexity", ((1,), (0,))), ("verbosity", ((1,), (0,))),
    }
    water = [r for r in out.rows if r["prompt"] == "Summarize the water cycle."]
    assert len({tuple(r["responses"]) for r in water}) == 3  # 3 distinct responses -> 3 pairs
    assert out.stats["skipped_duplicate_response"] == 1
    assert not [r for r in out.rows if r["prompt"] == "Write a limerick about a cat."]  # one response only
    multi_turn = [r for r in out.rows if "<extra_id_1>" in r["prompt"]]
    assert [r["cluster"] for r in multi_turn] == ["verbosity"]
    assert json.loads(multi_turn[0]["prompt_messages"]) == [
        {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"}]
    assert all(r["prompt_messages"] is None for r in out.rows if r not in multi_turn)
    assert out.stats["multi_turn_prompts"] == 1
    assert len({r["example_id"] for r in out.rows}) == len(out.rows) == 16
    wide = helpsteer2.to_rankings(records(fixtures_dir / "helpsteer2.jsonl"),
                                  helpsteer2.HelpSteer2Options(min_gap=2), source="hs")
    assert all(len(r["responses"]) == 2 for r in wide.rows) and len(wide.rows) < len(out.rows)


def test_helpsteer2_multi_turn_prompts_become_chat_messages_that_the_template_renders(fixtures_dir, tiny_tokenizer):
    text = "Hi\n<extra_id_1>Assistant\nHello! How can I help?\n<extra_id_1>User\nName a prime."
    messages = json.loads(helpsteer2.prompt_messages_of(text))
    assert messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                        {"role": "user", "content": "Name a prime."}]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.index("Hi") < rendered.index("Hello! How can I help?") < rendered.index("Name a prime.")
    assert rendered.count("assistant") == 2 and "extra_id" not in rendered  # a past answer, then the one to score
    assert encode_prompt(tiny_tokenizer, messages) == tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    crlf = "Hi\r\n\r\n<extra_id_1>Assistant\r\nHello! How can I help?\r\n<extra_id_1>User \r\nName a prime."
    assert json.loads(helpsteer2.prompt_messages_of(crlf)) == messages
    for malformed in ("Hi<extra_id_1>User\nAgain",  # two user turns in a row
                      "Hi<extra_id_1>Assistant\nHello",  # ends on the assistant's turn
                      "<extra_id_1>Assistant\nHello<extra_id_1>User\nHi"):  # an empty first turn
        assert helpsteer2.prompt_messages_of(malformed) is None
    assert helpsteer2.prompt_messages_of("What is 2 + 2?") is None
    preference = helpsteer2.to_rankings(records(fixtures_dir / "helpsteer2-extra" / "preference" / "preference.jsonl"),
                                        helpsteer2.HelpSteer2Options(data="preference"), source="hs")
    assert [json.loads(r["prompt_messages"])[-1]["content"] for r in preference.rows
            if r["prompt_messages"] is not None] == ["And times 3?"]
    kept = helpsteer2.to_rankings(records(fixtures_dir / "helpsteer2.jsonl"),
                                  helpsteer2.HelpSteer2Options(split_turns=False), source="hs")
    assert all(r["prompt_messages"] is None for r in kept.rows) and "multi_turn_prompts" not in kept.stats


def test_helpsteer2_reads_gzipped_jsonl_and_rejects_out_of_range_ratings(tmp_path, fixtures_dir):
    text = (fixtures_dir / "helpsteer2.jsonl").read_text()
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write(text)
    assert len(records(tmp_path / "train.jsonl.gz")) == 9
    bad = json.loads(text.splitlines()[0]) | {"verbosity": 7}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(RawSchemaError, match=r"bad.jsonl line 1, field 'verbosity': rating 7 is not an integer in 0..4"):
        helpsteer2.to_rankings(records(tmp_path / "bad.jsonl"), helpsteer2.HelpSteer2Options(), source="hs")


def _helpsteer2_release(tmp_path: Path, fixtures_dir: Path) -> Path:
    """The release's layout (`hf download nvidia/HelpSteer2`): ratings beside the other two data_dirs."""
    release = tmp_path / "HelpSteer2"
    shutil.copytree(fixtures_dir / "helpsteer2-extra", release)
    with gzip.open(release / "train.jsonl.gz", "wt") as f:
        f.write((fixtures_dir / "helpsteer2.jsonl").read_text())
    return release


def test_helpsteer2_reads_the_whole_release_folder_for_its_ratings(tmp_path, fixtures_dir):
    release = _helpsteer2_release(tmp_path, fixtures_dir)
    alone = helpsteer2.to_rankings(records(fixtures_dir / "helpsteer2.jsonl"), helpsteer2.HelpSteer2Options(),
                                   source="hs")
    out = helpsteer2.to_rankings(records(release), helpsteer2.HelpSteer2Options(), source="hs")
    assert out.rows == alone.rows
    assert out.stats["skipped_preference_records"] == 6 and out.stats["skipped_disagreements_records"] == 4


def test_helpsteer2_names_the_data_setting_when_the_source_holds_only_the_other_kind(fixtures_dir):
    with pytest.raises(RawSchemaError, match="no HelpSteer2 ratings records but 6 preference records .*"
                                             "set helpsteer2.data=preference"):
        helpsteer2.to_rankings(records(fixtures_dir / "helpsteer2-extra"), helpsteer2.HelpSteer2Options(), source="hs")
    with pytest.raises(RawSchemaError, match="no HelpSteer2 preference records but 9 ratings records"):
        helpsteer2.to_rankings(records(fixtures_dir / "helpsteer2.jsonl"),
                               helpsteer2.HelpSteer2Options(data="preference"), source="hs")


def test_helpsteer2_preference_ranks_each_pair_by_the_sign_of_its_strength(tmp_path, fixtures_dir):
    release = _helpsteer2_release(tmp_path, fixtures_dir)
    options = helpsteer2.HelpSteer2Options(data="preference")
    out = helpsteer2.to_rankings(records(release), options, source="hs")
    raw = [json.loads(line) for line in (release / "preference" / "preference.jsonl").read_text().splitlines()]
    kept = [r for r in raw[:5] if r["preference_strength"] != 0]
    assert [r["responses"] for r in out.rows] == [[p["response_1"], p["response_2"]] for p in kept]
    # strengths 2, -1, -3, 1: response_2, response_1, response_1, response_2 first
    assert [r["ranking"] for r in out.rows] == [[[1], [0]], [[0], [1]], [[0], [1]], [[1], [0]]]
    assert out.rows[2]["responses"][1] == "Clouds make rain." and kept[2]["preference_strength"] == -3
    assert all(r["cluster"] is None for r in out.rows)
    assert out.stats == out.stats | {"skipped_weak_or_no_preference": 1, "skipped_duplicate_record": 1,
                                     "skipped_ratings_records": 9, "skipped_disagreements_records": 4, "rankings": 4}
    strong = helpsteer2.to_rankings(records(release), options.model_copy(update={"min_strength": 2}), source="hs")
    assert len(strong.rows) == 2
    config = IngestConfig(dataset="helpsteer2", path=str(release), helpsteer2={"data": "preference"},
                          split=SplitConfig(fractions=(0.5, 0.5, 0.0)))
    built = build_rankings(config)
    assert built.table.num_rows == 4 and built.summary["labels"] is None
    bad = raw[0] | {"preference_strength": 5}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(RawSchemaError, match=r"bad.jsonl line 1, field 'preference_strength': strength 5 is not an "
                                             r"integer in -3..3"):
        helpsteer2.to_rankings(records(tmp_path / "bad.jsonl"), options, source="hs")


# --- PRISM -----------------------------------------------------------------------------------------


def _prism_lines(fixtures_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (fixtures_dir / "prism" / name).read_text().splitlines()]


def test_prism_ranks_each_opening_turn_by_score_with_the_participants_region(fixtures_dir):
    out = prism.to_rankings(records(fixtures_dir / "prism"), PrismOptions(), source="p")
    conversations = {c["conversation_id"]: c for c in _prism_lines(fixtures_dir, "conversations.jsonl")}
    regions = {u["user_id"]: u["location"]["special_region"] for u in _prism_lines(fixtures_dir, "survey.jsonl")}
    assert out.stats["skipped_other_records"] == 1  # the utterances file beside them
    assert out.stats["participants"] == 10 and out.stats["conversations"] == 20
    for row in out.rows:
        (cid,) = [c for c in conversations if short_hash("prism", c) == row["example_id"]]
        conversation = conversations[cid]
        opening = sorted((m for m in conversation["conversation_history"] if m["turn"] == 0 and m["role"] == "model"),
                         key=lambda m: m["within_turn_id"])
        assert row["prompt"] == conversation["opening_prompt"]
        assert row["responses"] == [m["content"] for m in opening]  # turn 1's A/B answers are not read
        scores = [m["score"] for m in opening]
        # tiers best first, every response once, equal scores together
        assert sorted(j for tier in row["ranking"] for j in tier) == [0, 1, 2, 3]
        tier_scores = [{scores[j] for j in tier} for tier in row["ranking"]]
        assert all(len(t) == 1 for t in tier_scores)
        assert [t.pop() for t in tier_scores] == sorted(set(scores), reverse=True)
        assert row["cluster"] == f"location.special_region={regions[conversation['user_id']]}"
    assert any(len(tier) == 2 for row in out.rows for tier in row["ranking"])  # conversation c5's tie
    assert out.stats == out.stats | {"skipped_user_not_in_survey": 2, "skipped_no_profile": 2,  # Prefer not to say
                                     "skipped_all_tied": 1, "skipped_short_slate": 2, "skipped_rare_profile": 2,
                                     "profiles": 4, "rankings": 11}
    assert len({r["example_id"] for r in out.rows}) == len(out.rows)
    # Africa and Latin America tie at 2 rankings; the tie goes to the first label
    assert {r["cluster"] for r in out.rows} == {f"location.special_region={region}"
                                                for region in ("UK", "US", "Europe", "Africa")}


def test_prism_reads_the_releases_empty_text_as_no_text(tmp_path, fixtures_dir):
    # The release writes "EMPTY STRING" for a text that was empty: never a prompt or a response.
    shutil.copy(fixtures_dir / "prism" / "survey.jsonl", tmp_path / "survey.jsonl")
    conversation = _prism_lines(fixtures_dir, "conversations.jsonl")[0]
    history = conversation["conversation_history"]
    no_answer = [dict(m, content="EMPTY STRING") if m.get("within_turn_id") == 1 else m for m in history]
    no_prompt = [dict(m, content=" EMPTY STRING ") if m["role"] == "user" and m["turn"] == 0 else m for m in history]
    lines = [conversation, conversation | {"conversation_id": "c-no-answer", "conversation_history": no_answer},
             conversation | {"conversation_id": "c-no-prompt", "conversation_history": no_prompt}]
    (tmp_path / "conversations.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = prism.to_rankings(records(tmp_path), PrismOptions(top_profiles=None, min_responses=3), source="p")
    by_id = {row["example_id"]: row for row in out.rows}
    assert set(by_id) == {short_hash("prism", "c0"), short_hash("prism", "c-no-answer")}
    assert len(by_id[short_hash("prism", "c0")]["responses"]) == 4
    assert "EMPTY STRING" not in by_id[short_hash("prism", "c-no-answer")]["responses"]
    assert len(by_id[short_hash("prism", "c-no-answer")]["responses"]) == 3
    assert out.stats["skipped_no_opening_prompt"] == 1


def test_prism_profiles_from_nested_and_plain_survey_columns(fixtures_dir):
    options = PrismOptions(fields=("gender", "ethnicity.simplified"), top_profiles=None, min_responses=3)
    out = prism.to_rankings(records(fixtures_dir / "prism"), options, source="p")
    assert "gender=Female|ethnicity.simplified=White" in {r["cluster"] for r in out.rows}
    assert "skipped_short_slate" not in out.stats and out.stats["profiles"] == len({r["cluster"] for r in out.rows})
    three = [r for r in out.rows if len(r["responses"]) == 3]
    assert len(three) == 2  # the conversation with three answers, and the one where two models said the same
    missing = prism.to_rankings(records(fixtures_dir / "prism"), PrismOptions(fields=("location.no_such_key",)),
                                source="p")
    assert missing.rows == [] and missing.stats["skipped_no_profile"] == 18


def test_prism_names_a_bad_score_and_asks_for_the_survey(tmp_path, fixtures_dir):
    conversations = _prism_lines(fixtures_dir, "conversations.jsonl")
    shutil.copy(fixtures_dir / "prism" / "survey.jsonl", tmp_path / "survey.jsonl")
    conversations[1]["conversation_history"][3]["score"] = 250
    (tmp_path / "conversations.jsonl").write_text("\n".join(json.dumps(c) for c in conversations) + "\n")
    with pytest.raises(RawSchemaError, match=r"conversations.jsonl line 2, field 'conversation_history\[3\]', "
                                             r"key 'score': 250 is not a score in 1..100"):
        prism.to_rankings(records(tmp_path), PrismOptions(), source="p")
    with pytest.raises(RawSchemaError, match="no survey records .* survey.jsonl beside conversations.jsonl"):
        prism.to_rankings(records(fixtures_dir / "prism" / "conversations.jsonl"), PrismOptions(), source="p")



@pytest.mark.parametrize(("message", "expected", "field"), [
    ("not a message", r"\[1\]': a message needs 'turn', 'role' and 'content'", ""),
    ({"turn": "0", "role": "model", "content": "hi", "score": 50}, r"\[1\]', key 'turn': '0' is not an integer",
     ".turn"),
    ({"turn": 0, "role": "assistant", "content": "hi", "score": 50}, r"\[1\]', key 'role': 'assistant' is not one of",
     ".role"),
    ({"turn": 0, "role": "model", "content": None, "score": 50}, r"\[1\]', key 'content': expected text, got NoneType",
     ".content"),
    ({"turn": 0, "role": "model", "content": "hi", "score": 10**400},
     r"\[1\]', key 'score': 1000.* is not a score in 1..100", ".score"),
    ({"turn": 0, "role": "model", "content": "hi", "score": None}, r"\[1\]', key 'score': None is not a score", ".score"),
])
def test_prism_names_a_malformed_message_even_of_a_participant_left_out(tmp_path, fixtures_dir, message, expected,
                                                                         field):
    survey = _prism_lines(fixtures_dir, "survey.jsonl")
    (tmp_path / "survey.jsonl").write_text("\n".join(json.dumps(u) for u in survey) + "\n")
    conversation = _prism_lines(fixtures_dir, "conversations.jsonl")[0] | {"user_id": "user8"}  # Prefer not to say
    conversation["conversation_history"][1] = message
    (tmp_path / "conversations.jsonl").write_text(json.dumps(conversation) + "\n")
    with pytest.raises(RawSchemaError, match=r"conversations.jsonl line 1, field 'conversation_history" + expected) as raised:
        prism.to_rankings(records(tmp_path), PrismOptions(), source="p")
    assert raised.value.field == "conversation_history[1]" + field


def test_prism_reads_a_repeated_file_once_and_refuses_a_participant_with_two_profiles(tmp_path, fixtures_dir):
    (tmp_path / "copy").mkdir()
    for name in ("survey.jsonl", "conversations.jsonl"):
        shutil.copy(fixtures_dir / "prism" / name, tmp_path / name)
        shutil.copy(fixtures_dir / "prism" / name, tmp_path / "copy" / name)
    once = prism.to_rankings(records(fixtures_dir / "prism"), PrismOptions(), source="p")
    twice = prism.to_rankings(records(tmp_path), PrismOptions(), source="p")
    assert twice.rows == once.rows and twice.stats["skipped_duplicate_record"] == 10 + 20
    survey = _prism_lines(fixtures_dir, "survey.jsonl")
    survey[1] = survey[1] | {"user_id": "user0"}  # a UK and a second, other participant under one id
    (tmp_path / "copy" / "survey.jsonl").write_text("\n".join(json.dumps(u) for u in survey) + "\n")
    shutil.copy(fixtures_dir / "prism" / "conversations.jsonl", tmp_path / "copy" / "conversations.jsonl")
    with pytest.raises(RawSchemaError, match="user_id 'user0' is also the participant of"):
        prism.to_rankings(records(tmp_path / "copy"), PrismOptions(fields=("age",)), source="p")
    with pytest.raises(RawSchemaError, match=r"^1 source record\(s\) cannot be read"):  # not user0's conversations too
        build_rankings(IngestConfig(dataset="prism", path=str(tmp_path / "copy"), prism={"fields": ["age"]}))
    # validation=drop: the second survey record is set aside, and so are user0's conversations, whose
    # profile is now in doubt; nothing is lost (each is in the rejects with its reason)
    rejects = RawRejects(drop=True)
    dropped = prism.to_rankings(records(tmp_path / "copy"), PrismOptions(fields=("age",)), source="p", rejects=rejects)
    kept = prism.to_rankings(records(fixtures_dir / "prism"), PrismOptions(fields=("age",)), source="p").rows
    conversations = [json.loads(line) for line in (fixtures_dir / "prism" / "conversations.jsonl").read_text().splitlines()]
    of_user0 = sum(1 for c in conversations if c["user_id"] == "user0")
    assert of_user0 > 0 and len(rejects.rows) == 1 + of_user0
    assert "is also the participant of" in rejects.rows[0]["reason"]
    assert all("the survey record of user_id 'user0'" in r["reason"] for r in rejects.rows[1:])
    assert {r["field"] for r in rejects.rows} == {"user_id"}
    assert {r["example_id"] for r in dropped.rows} < {r["example_id"] for r in kept}


def test_a_strict_prism_ingest_names_the_bad_survey_records_before_what_follows_from_them(tmp_path, fixtures_dir):
    survey = [{k: v for k, v in json.loads(line).items() if k != "user_id"}
              for line in (fixtures_dir / "prism" / "survey.jsonl").read_text().splitlines()]
    (tmp_path / "survey.jsonl").write_text("".join(json.dumps(s) + "\n" for s in survey))
    shutil.copy(fixtures_dir / "prism" / "conversations.jsonl", tmp_path / "conversations.jsonl")
    with pytest.raises(RawSchemaError) as err:
        build_rankings(IngestConfig(dataset="prism", path=str(tmp_path)))
    lines = str(err.value).splitlines()
    assert lines[0] == f"{len(survey)} source record(s) cannot be read or lack the dataset's fields:"
    assert f"{tmp_path / 'survey.jsonl'} line 1: a PRISM record needs field(s) ['user_id']" in lines[1]
    assert "After them, reading stopped at: " in str(err.value) and "no survey records" in str(err.value)


# ---------------------------------------------------------------------------------------------------
# record-level rules each adapter states, on records written here (mutation round 3)


def _record(i: int, data: dict) -> Record:
    return Record(f"line {i + 1}", data)


def test_persona_two_personas_of_one_profile_asked_one_question_are_two_rankings():
    base = {"instruction": "What should I cook tonight?", "original": "Pasta.", "data": "A curry, as you like spice."}
    records = [_record(0, base | {"persona": "age: 30\nsex: Female\nrace: White alone\nhobby: climbing"}),
               _record(1, base | {"persona": "age: 31\nsex: Female\nrace: White alone\nhobby: chess",
                                  "data": "A salad, light before chess."})]
    out = persona.to_rankings(records, PersonaOptions(top_profiles=None), source="p", seed=0)
    assert len(out.rows) == 2 and "skipped_duplicate_record" not in out.stats


def _prism(answers: list[tuple[int, str, int]], **options) -> dict:
    survey = _record(0, {"user_id": "u1", "survey_only": False, "location": {"special_region": "UK"}})
    history = [{"turn": 0, "role": "user", "content": "Hi?"}]
    history += [{"turn": 0, "role": "model", "content": text, "within_turn_id": w, "score": score}
                for w, text, score in answers]
    conversation = _record(1, {"conversation_id": "c1", "user_id": "u1", "conversation_history": history})
    (row,) = prism.to_rankings([survey, conversation], PrismOptions(top_profiles=None, **options), source="p").rows
    return row


def test_prism_reads_an_answer_repeated_with_other_whitespace_once_and_orders_by_within_turn_id():
    row = _prism([(0, "Hello.", 90), (1, "Hello.\n", 80), (2, "Hey.", 10), (3, "Yo.", 50)], min_responses=3)
    assert row["responses"] == ["Hello.", "Hey.", "Yo."]
    row = _prism([(3, "d", 10), (0, "a", 90), (2, "c", 30), (1, "b", 60)])  # the history in another order
    assert row["responses"] == ["a", "b", "c", "d"] and row["ranking"] == [[0], [1], [2], [3]]


def test_generic_default_example_ids_differ_by_cluster():
    """Two groups' rankings of the same responses are two rankings, not one repeated: each keeps the id
    it has alone (a repeat would take the first free -2 suffix instead)."""
    row = {"prompt": "p", "responses": ["a", "b"], "ranking": [[0], [1]]}
    x, y = _record(0, row | {"cluster": "x"}), _record(1, row | {"cluster": "y"})
    out = generic.to_rankings([x, y], source="g")
    alone = [generic.to_rankings([record], source="g").rows[0]["example_id"] for record in (x, y)]
    assert [r["example_id"] for r in out.rows] == alone and alone[0] != alone[1]
    assert "repeated_rankings" not in out.stats


def _helpsteer2_rated(prompt, response, **ratings) -> dict:
    return {"prompt": prompt, "response": response, "helpfulness": 2, "correctness": 2, "coherence": 2,
            "complexity": 2, "verbosity": 2} | ratings


def test_helpsteer2_skips_empty_text_reads_whole_float_ratings_and_leaves_a_missing_rating_unranked():
    records = [_record(i, data) for i, data in enumerate([
        _helpsteer2_rated("  ", "Blank prompt."),
        _helpsteer2_rated("Name a colour.", None),  # a release row with no response
        _helpsteer2_rated("Name a colour.", "Red.", helpfulness=3.0, correctness=None),  # Parquet floats, a null
        _helpsteer2_rated("Name a colour.", "Blue, the sky's.", helpfulness=1, correctness=4),
    ])]
    out = helpsteer2.to_rankings(records, helpsteer2.HelpSteer2Options(), source="hs")
    assert out.stats["skipped_empty_prompt"] == 1 and out.stats["skipped_empty_response"] == 1
    assert [(r["cluster"], r["responses"], r["ranking"]) for r in out.rows] == [
        ("helpfulness", ["Red.", "Blue, the sky's."], [[0], [1]])]  # correctness: one rating is missing
    with pytest.raises(RawSchemaError, match=r"line 1, field 'helpfulness': rating 2.5 is not an integer in 0..4"):
        helpsteer2.to_rankings([_record(0, _helpsteer2_rated("P", "R", helpfulness=2.5))],
                               helpsteer2.HelpSteer2Options(), source="hs")


def test_helpsteer2_preference_skips_pairs_missing_a_text_or_of_one_response_twice():
    pair = {"prompt": "Say hi.", "response_1": "Hi.", "response_2": "Hello there.", "preference_strength": 2}
    records = [_record(0, pair | {"response_2": None}), _record(1, pair | {"response_2": " Hi. "}), _record(2, pair)]
    out = helpsteer2.to_rankings(records, helpsteer2.HelpSteer2Options(data="preference"), source="hs")
    assert out.stats["skipped_missing_text"] == 1 and out.stats["skipped_identical_responses"] == 1
    assert [r["responses"] for r in out.rows] == [["Hi.", "Hello there."]]


def test_ultrafeedback_skips_an_empty_instruction_and_names_completions_that_are_not_a_list():
    out = ultrafeedback.to_rankings([_record(0, {"instruction": " \n", "completions": []})],
                                    UltraFeedbackOptions(), source="uf", seed=0)
    assert out.rows == [] and out.stats["skipped_empty_prompt"] == 1
    with pytest.raises(RawSchemaError, match="line 1: 'completions' must be a list, got dict"):
        ultrafeedback.to_rankings([_record(0, {"instruction": "Q?", "completions": {"response": "A"}})],
                                  UltraFeedbackOptions(), source="uf", seed=0)


def test_persona_skips_missing_text_a_repeated_record_and_an_age_that_is_not_a_number():
    who = "age: 30\nsex: Female\nrace: White alone"
    base = {"persona": who, "instruction": "What should I cook tonight?", "original": "Pasta.",
            "data": "A curry, as you like spice."}
    records = [_record(0, base | {"original": None}), _record(1, base), _record(2, base),
               _record(3, base | {"persona": who.replace("30", "thirty")})]
    out = persona.to_rankings(records, PersonaOptions(top_profiles=None), source="p", seed=0)
    assert len(out.rows) == 1 and out.rows[0]["cluster"] == "age=18-44|sex=Female|race=White"
    assert out.stats["skipped_missing_text"] == 1 and out.stats["skipped_duplicate_record"] == 1
    assert out.stats["skipped_no_profile"] == 1
