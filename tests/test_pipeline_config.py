"""PipelineConfig: named presets, key=value overrides, and the errors a user sees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from moplex_core.config import (
    TINY_MODEL,
    PipelineConfig,
    pipeline_preset,
    preset_description,
    preset_names,
    with_overrides,
)
from moplex_core.methods import method_config

from prefect_server_fixtures import prefect_environment


def test_every_shipped_preset_loads_and_describes_itself():
    assert set(preset_names()) >= {"synthetic-demo", "ultrafeedback-paper", "persona-paper", "helpsteer2", "prism"}
    for name in preset_names():
        config = pipeline_preset(name)
        assert preset_description(name)
        assert config.train.k >= 1 and config.cache.model


def test_the_demo_preset_builds_its_own_tiny_model():
    demo = pipeline_preset("synthetic-demo")
    assert demo.ingest.dataset == "synthetic"
    assert (demo.ingest.synthetic.k, demo.ingest.synthetic.m, demo.train.k) == (3, 4, 3)
    assert demo.cache.model == TINY_MODEL and demo.augment.model == TINY_MODEL and demo.augment.backend == "hf"


def test_overrides_reach_nested_stage_blocks_and_keep_the_rest():
    demo = pipeline_preset("synthetic-demo")
    changed = with_overrides(demo, ["ingest.synthetic.n=90", "train.em_iterations=2", "fault.stage=train",
                                    "augment=null"])
    assert changed.ingest.synthetic.n == 90 and changed.train.em_iterations == 2
    assert changed.fault.stage == "train" and changed.augment is None
    assert changed.cache == demo.cache and changed.tiny_model == demo.tiny_model


def test_values_that_would_fail_a_later_stage_are_refused_up_front():
    demo = pipeline_preset("synthetic-demo")
    refused = {
        "train.lr=Infinity": "train.lr: Input should be a finite number",
        "ingest.split.fractions=[NaN, 0.5, 0.5]": "ingest.split.fractions.0: Input should be a finite number",
        "evaluate.device=gpu": "evaluate.device: 'gpu' is not a device: give auto, cpu, cuda, cuda:N, mps or mps:N",
        "train.seed=-1": "train.seed: Input should be greater than or equal to 0",
        "ingest.seed=-1": "ingest.seed: Input should be greater than or equal to 0",
        "tiny_model.heads=3": "\n  tiny_model.hidden_size 64 / tiny_model.heads 3 must be a whole, even head size",
        "train.gamma_min=0.5": "\n  train.gamma_min = 0.5 is above 1/k",
        "root=": "root is empty",
        "cache.model=": "cache.model: is empty: give a local model folder or a hub name",
        "ingest.synthetic.n=99999999999999999999": "ingest.synthetic.n: Input should be less than or equal to 10000000",
        "ingest.synthetic.n=10000000": "ingest.synthetic: n x m x k = 10000000 x 4 x 3 values is more than",
        "ingest.split.fractions=[true,false,false]": "ingest.split.fractions.0: expected a number, not a boolean",
        "ingest.synthetic.alpha=[0.5,true]": "ingest.synthetic.alpha.1: expected a number, not a boolean",
        'ingest.split={"fractions":[1,0,false]}': "ingest.split.fractions.2: expected a number, not a boolean",
        "train.k=[true]": "train.k: Input should be a valid integer",
        "ingest.path= ": "ingest.path: is empty: give a file or folder",
    }
    for assignment, message in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)) as refusal:
            with_overrides(demo, [assignment])
        assert "(got 'gpu')" not in str(refusal.value) and ": train." not in str(refusal.value)  # said once
    assert with_overrides(demo, ["train.device=cuda:1"]).train.device == "cuda:1"
    # a setting that holds text keeps what was typed: a root or a revision that reads as a number
    assert with_overrides(demo, ["root=2024"]).root == str(Path("2024").absolute())
    assert with_overrides(demo, ["evaluate.method=1e3"]).evaluate.method == "1e3"
    paper = pipeline_preset("ultrafeedback-paper")
    assert with_overrides(paper, ["ingest.revision=2024"]).ingest.revision == "2024"  # str | None
    assert with_overrides(paper, ["ingest.revision=null"]).ingest.revision is None
    assert with_overrides(demo, ["train.em_iterations=3"]).train.em_iterations == 3
    assert with_overrides(demo, ['evaluate.method="quoted"']).evaluate.method == "quoted"


def test_unknown_keys_and_unknown_presets_are_refused():
    demo = pipeline_preset("synthetic-demo")
    with pytest.raises(ValueError, match="train.clusters: unknown key"):
        with_overrides(demo, ["train.clusters=3"])
    with pytest.raises(ValueError, match="extra_forbidden"):
        PipelineConfig.model_validate({**demo.model_dump(mode="json"), "epochs": 2})
    with pytest.raises(ValueError, match="fault"):
        with_overrides(demo, ["fault.stage=deploy"])
    with pytest.raises(ValueError, match="fault.stage = 'augment' names a stage this pipeline skips \\(augment is null"):
        with_overrides(demo, ["fault.stage=augment", "augment=null"])
    with pytest.raises(ValueError, match="fault.stage = 'model' names a stage this pipeline skips \\(neither model"):
        with_overrides(demo, ["fault.stage=model", "augment=null", "cache.model=/models/base"])
    with pytest.raises(ValueError, match="unknown pipeline preset 'nope'.*synthetic-demo"):
        pipeline_preset("nope")
    with pytest.raises(ValueError, match="unknown pipeline preset 'synthetic-dmeo'.*did you mean synthetic-demo\\?"):
        pipeline_preset("synthetic-dmeo")
    with pytest.raises(ValidationError, match="fit_split"):
        PipelineConfig.model_validate({**demo.model_dump(mode="json"), "evaluate": {"splits": ["test"]}})


def test_hard_em_refuses_backtracks_and_its_baseline_turns_them_off():
    base = with_overrides(pipeline_preset("synthetic-compare"), ["train.backtracks=2"])
    with pytest.raises(ValueError, match="hard EM .* never backtracks: set train.backtracks = 0"):
        with_overrides(base, ["train.hard=true"])
    assert method_config(base, "maxmin_bt", 0).train.backtracks == 0
    assert method_config(base, "moplex", 0).train.backtracks == 2


def test_the_config_round_trips_through_json_as_a_flow_parameter_does():
    demo = pipeline_preset("synthetic-demo")
    assert PipelineConfig.model_validate_json(demo.model_dump_json()) == demo
    schema = PipelineConfig.model_json_schema()  # what the Prefect UI renders as a form
    assert {"ingest", "augment", "cache", "train", "evaluate", "fault"} <= set(schema["properties"])


def test_the_pipeline_flows_parameters_are_described_in_the_run_form():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import moplex_pipeline

    described = {name: field.get("description", "") for name, field in
                 parameter_schema(moplex_pipeline.fn).model_dump()["properties"].items()}
    assert set(described) == {"preset", "overrides", "config"} and all(described.values())
    assert "root=" in described["overrides"] and all(name in described["preset"] for name in preset_names())


def test_moplex_run_lists_the_presets_and_refuses_a_bad_override(capsys):
    from moplex_core.cli import main

    assert main(["run", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in preset_names())
    assert main(["run"]) == 1
    missing = capsys.readouterr()
    assert "moplex run: name a preset" in missing.err and missing.out == listing
    assert main(["run", "synthetic-demo", "--set", "train.clusters=3"]) == 1
    assert "train.clusters" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["run", "synthetic-demo", "--set", "train.k=2", "train.lr=0.1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and ("moplex run: error: unrecognized arguments: train.lr=0.1 (each setting takes its "
                                      "own --set: --set train.lr=0.1)") in err
    assert err.startswith("usage: moplex run [-h]")  # the subcommand's usage, not moplex's
    for threads in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exit_:
            main(["run", "synthetic-demo", "--threads", threads])
        assert exit_.value.code == 2
        assert f"argument --threads: expected an integer of at least 1, got '{threads}'" in capsys.readouterr().err


def test_moplex_run_refuses_a_root_under_a_file_before_prefect_starts(tmp_path, capsys):
    from moplex_core.cli import main

    (tmp_path / "afile").write_text("")
    for root in (tmp_path / "afile", tmp_path / "afile" / "below"):
        assert main(["run", "synthetic-demo", "--root", str(root)]) == 1
        assert (f"moplex run: the artifact root {root} cannot be a folder: {tmp_path / 'afile'} is a file"
                in capsys.readouterr().err)


def test_an_interrupt_ends_with_one_line_and_status_130(monkeypatch, capsys):
    from moplex_core import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_inspect", interrupted)
    assert cli.main(["inspect", "anything"]) == 130
    assert capsys.readouterr().err == "\nmoplex inspect: interrupted.\n"  # it writes nothing to resume
    monkeypatch.setattr(cli, "_ingest", interrupted)
    assert cli.main(["ingest", "--dataset", "synthetic"]) == 130
    err = capsys.readouterr().err
    assert "moplex ingest: interrupted." in err and "the same command resumes" in err and "Traceback" not in err


def test_a_closed_pipe_ends_the_listing_quietly():
    # `moplex run --list | head -1`: the reader leaves early; no BrokenPipeError traceback.
    import subprocess
    import sys

    listing = subprocess.Popen([sys.executable, "-c", "import sys; from moplex_core.cli import main; "
                                "sys.exit(main(['run', '--list']))"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    listing.stdout.close()  # before the child writes: its first write meets a closed pipe
    _, err = listing.communicate(timeout=60)
    assert listing.returncode == 141, err.decode()
    assert b"Traceback" not in err


def test_a_broken_pipe_elsewhere_is_not_mistaken_for_the_reader_leaving():
    # stdout open, but the command's own pipe or socket breaks: that error must show
    import subprocess
    import sys

    code = ("import sys, moplex_core.cli as cli\n"
            "def broken(args):\n    raise BrokenPipeError(32, 'worker pipe')\n"
            "cli._run = broken\nsys.exit(cli.main(['run', '--list']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "BrokenPipeError: [Errno 32] worker pipe" in done.stderr, done.stderr


def test_a_temporary_server_that_does_not_start_in_time_ends_in_one_line(tmp_path):
    # Prefect's own RuntimeError out of the flow call (not a failure inside the run): no traceback.
    import subprocess
    import sys

    env = prefect_environment(tmp_path / "home", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    done = subprocess.run([sys.executable, "-m", "moplex_core.cli", "run", "synthetic-demo", "--root",
                           str(tmp_path / "artifacts"), "--set", "ingest.synthetic.n=60"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "moplex run: the run could not start: Timed out while attempting to connect to ephemeral" in done.stderr
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=1 s" in done.stderr
    assert not (tmp_path / "artifacts").exists()  # nothing ran


def test_local_paths_are_made_absolute_where_the_config_is_read(tmp_path, monkeypatch):
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    config = with_overrides(pipeline_preset("synthetic-demo"),
                            ["root=runs", "cache.model=my-model", "augment.model=Qwen/Qwen3-0.6B"])
    assert config.root == str(tmp_path / "runs")  # the manifests record paths derived from it
    assert config.cache.model == str(tmp_path / "my-model")
    assert config.augment.model == "Qwen/Qwen3-0.6B"  # a hub name: no such local folder
    assert pipeline_preset("synthetic-demo").cache.model == TINY_MODEL
    generic = with_overrides(pipeline_preset("synthetic-demo"), ["ingest.dataset=generic", "ingest.path=~/data.jsonl"])
    assert generic.ingest.path == str(Path.home() / "data.jsonl")


def test_a_stage_device_this_machine_lacks_is_refused_before_the_first_stage(monkeypatch):
    import torch

    from moplex_core.pipeline import run_stages

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    config = with_overrides(pipeline_preset("synthetic-demo"), ["evaluate.device=cuda:0"])
    with pytest.raises(ValueError, match="evaluate.device: device 'cuda:0': this machine has no CUDA device"):
        run_stages(config, lambda name, *args, **kwargs: ran.append(name))
    assert ran == []


def test_first_day_mistakes_are_named_with_the_fix():
    from moplex_core.config import ingest_preset

    demo = pipeline_preset("synthetic-demo")
    for assignment, said in [
        ('evaluate.splits=["tset"]', "evaluate.splits.0: Input should be 'train', 'validation' or 'test' (got 'tset')"),
        ("ingest.split.fractions=[0.5,0.5]", "ingest.split.fractions: expected 3 values, got 2 ([0.5, 0.5])"),
        ("ingest.split.fractions=[0.5]", "ingest.split.fractions: expected 3 values, got 1 ([0.5])"),
        ("ingest.split.fractions=0.6,0.2,0.2", "a list is written as JSON: ingest.split.fractions='[0.6, 0.2, 0.2]'"),
        ("train.lora_targets=1", """a list is written as JSON: train.lora_targets='["1"]'"""),  # text stays text
        ("train.lora_targets=q_proj,2", """train.lora_targets='["q_proj", "2"]'"""),
        ("ingest.revision.main=1", "ingest.revision.main: 'revision' is not a block of ingest"),  # a null setting
        ("augment=null augment.n_generated=3", "augment.n_generated: augment is null here, so it has no 'n_generated' "
                                               "to set; give the whole block first (augment={...}"),
    ]:
        with pytest.raises(ValueError) as refused:
            with_overrides(demo, assignment.split(" "))
        assert said in str(refused.value), str(refused.value)
    with pytest.raises(ValueError, match="did you mean synthetic-demo?"):
        pipeline_preset("data/presets/synthetic-demo.json")
    with pytest.raises(ValueError, match="unknown ingest preset 'synthtic'; did you mean synthetic?"):
        ingest_preset("synthtic")


def test_show_config_prints_the_resolved_config_and_runs_nothing(tmp_path, capsys):
    import json

    from moplex_core.cli import main

    assert main(["run", "synthetic-demo", "--set", "train.k=2", "--root", str(tmp_path / "r"), "--show-config"]) == 0
    shown = PipelineConfig.model_validate(json.loads(capsys.readouterr().out))
    assert shown == with_overrides(pipeline_preset("synthetic-demo"), ["train.k=2", f"root={tmp_path / 'r'}"])
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [["run", "synthetic-demo", "--show-config"], ["inspect"], ["assign", "a", "b"],
                                     ["ingest", "--dataset", "synthetic"]])
def test_an_empty_root_is_refused_not_taken_for_the_default(command, tmp_path, capsys, monkeypatch):
    from moplex_core.cli import main

    monkeypatch.chdir(tmp_path)  # `--root "$ROOT"` with ROOT unset: nothing written to ./data/artifacts
    with pytest.raises(SystemExit) as exited:
        main([*command, "--root", ""])
    refusal = "argument --root: expected a folder (leave --root out for the default), got an empty value"
    assert exited.value.code == 2 and refusal in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("command", [["ingest", "--dataset", "generic", "--path", " "],
                                     ["augment", "--rankings", "ingest/x", "--model", ""],
                                     ["cache", "--rankings", "ingest/x", "--model", ""],
                                     ["assign", "a", "b", "--model", ""],
                                     ["experiment", "approximation", "--cache", "cache/x", "--model", ""],
                                     ["augment", "--rankings", ""], ["cache", "--model", "m", "--rankings", " "],
                                     ["assign", "train/x", ""], ["experiment", "approximation", "--cache", ""],
                                     ["experiment", "approximation", "--cache", "cache/x", "--out", ""],
                                     ["inspect", ""]])
def test_an_empty_path_or_model_is_refused_not_read_as_the_working_directory(command, tmp_path, capsys, monkeypatch):
    from moplex_core.cli import main

    monkeypatch.chdir(tmp_path)  # an empty path is the working directory to the OS: nothing read or hashed there
    with pytest.raises(SystemExit) as exited:
        main(command)
    flag = command[-2] if command[-2].startswith("--") else {"assign": "rankings", "inspect": "path"}[command[0]]
    assert exited.value.code == 2 and f"argument {flag}: expected a" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
