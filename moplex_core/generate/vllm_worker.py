"""The vLLM side of the ``vllm`` backend: a stand-alone script run under the vLLM environment's python.

vLLM cannot share Prefect's environment (DESIGN.md 8), so moplex_core.generate.vllm_backend starts
this file as a subprocess of another interpreter. It imports only the standard library and pyarrow
at module level and vllm when it serves, so that environment needs vllm and pyarrow, not moplex.
The parent imports the shard functions below too: one implementation of the protocol on both sides.

Protocol (one worker serves many request shards; the model loads once):
    argv    --settings SETTINGS.json   {"model", "dtype", "seed", "gpu_memory_utilization",
                                        "temperature", "top_p", "max_tokens"; optional "revision",
                                        "stop_token_ids"}
    stdin   one JSON line per request shard, {"requests": PATH, "responses": PATH}; end of input
            ends the worker with status 0
    stdout  protocol lines only (library output is sent to stderr): {"ready": true} once the model
            is loaded, then {"responses": PATH} once that shard is written
    files   request shard REQUEST_SCHEMA (one row per request: the prompt's token ids, rendered by
            the parent with the model's chat template, n and seed); response shard RESPONSE_SCHEMA
            (one row per request: n texts, their token counts and finish reasons), written to a
            temporary name and renamed, so a response shard that exists is whole
Any error ends the worker with a traceback on stderr and a non-zero status; the parent reports it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import pyarrow.parquet as pq

REQUEST_SCHEMA = pa.schema([
    pa.field("key", pa.string(), nullable=False),
    pa.field("prompt", pa.string()),  # for reading the shard; the worker uses the token ids
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("n", pa.int32(), nullable=False),
    pa.field("seed", pa.int64(), nullable=False),
])
RESPONSE_SCHEMA = pa.schema([
    pa.field("key", pa.string(), nullable=False),
    pa.field("texts", pa.list_(pa.string()), nullable=False),
    pa.field("token_counts", pa.list_(pa.int32()), nullable=False),
    pa.field("finish_reasons", pa.list_(pa.string()), nullable=False),
])
SETTINGS_KEYS = ("model", "dtype", "seed", "gpu_memory_utilization", "temperature", "top_p", "max_tokens")


def write_requests(path: str | Path, rows: list[dict[str, Any]]) -> None:
    _write_atomic(path, pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA))


def read_requests(path: str | Path) -> list[dict[str, Any]]:
    return _read(path, REQUEST_SCHEMA)


def write_responses(path: str | Path, rows: list[dict[str, Any]]) -> None:
    _write_atomic(path, pa.Table.from_pylist(rows, schema=RESPONSE_SCHEMA))


def read_responses(path: str | Path) -> list[dict[str, Any]]:
    return _read(path, RESPONSE_SCHEMA)


def llm_kwargs(settings: dict[str, Any]) -> dict[str, Any]:
    """Arguments of `vllm.LLM`; a hub model's ``revision`` (a commit), when the settings pin one, for
    the weights and the tokenizer alike, and ``max_model_len`` when they set one."""
    kwargs = {
        "model": settings["model"],
        "dtype": settings["dtype"],
        "seed": settings["seed"],
        "gpu_memory_utilization": settings["gpu_memory_utilization"],
    }
    if settings.get("revision"):
        kwargs.update(revision=settings["revision"], tokenizer_revision=settings["revision"])
    if settings.get("max_model_len"):
        kwargs["max_model_len"] = settings["max_model_len"]
    return kwargs


def sampling_kwargs(request: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Arguments of `vllm.SamplingParams` for one request: its n samples come from its own seed."""
    return {
        "n": request["n"],
        "temperature": settings["temperature"],
        "top_p": settings["top_p"],
        "max_tokens": settings["max_tokens"],
        "seed": request["seed"],
    }


def token_prompt(request: dict[str, Any]) -> dict[str, list[int]]:
    """The request's prompt as a vLLM TokensPrompt."""
    return {"prompt_token_ids": list(request["prompt_token_ids"])}


def response_row(request: dict[str, Any], completions: list[Any],
                 stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """A RESPONSE_SCHEMA row from a request and its vLLM CompletionOutputs (.text, .token_ids,
    .finish_reason). A completion that ends with one of ``stop_token_ids`` (the model's EOS) is
    "stop" also where vLLM said "length": vLLM releases that checked the length cap before the stop
    tokens called an EOS drawn as the last allowed token so (current ones check the EOS first)."""
    stops = set(stop_token_ids)
    return {
        "key": request["key"],
        "texts": [c.text for c in completions],
        "token_counts": [len(c.token_ids) for c in completions],
        "finish_reasons": ["stop" if str(c.finish_reason) == "length" and c.token_ids and c.token_ids[-1] in stops
                           else str(c.finish_reason) for c in completions],
    }


def read_settings(path: str | Path) -> dict[str, Any]:
    settings = json.loads(Path(path).read_text())
    missing = [k for k in SETTINGS_KEYS if k not in settings]
    if missing:
        raise ValueError(f"{path} lacks settings {missing}; it needs {list(SETTINGS_KEYS)}")
    return settings


def serve(settings: dict[str, Any], commands: Any, protocol: Any) -> None:
    """Load the model, then answer every command line of ``commands`` (see the module docstring)."""
    from vllm import LLM, SamplingParams

    llm = LLM(**llm_kwargs(settings))
    _say(protocol, {"ready": True})
    for line in commands:
        if not line.strip():
            continue
        command = json.loads(line)
        requests = read_requests(command["requests"])
        outputs = llm.generate(
            [token_prompt(r) for r in requests],
            [SamplingParams(**sampling_kwargs(r, settings)) for r in requests],
            use_tqdm=False,
        )
        stops = settings.get("stop_token_ids", ())
        write_responses(command["responses"],
                        [response_row(r, list(o.outputs), stops) for r, o in zip(requests, outputs, strict=True)])
        _say(protocol, {"responses": command["responses"]})


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(description="moplex vLLM generation worker (see the module docstring)")
    parser.add_argument("--settings", required=True)
    args = parser.parse_args(argv)
    # Keep the real stdout for protocol lines and send everything else printed there (vLLM logs to
    # stdout) to stderr, which the parent keeps in a log file.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Exit without the interpreter's teardown, where vLLM's own can hang or fail: after the last answer
    # it would fail a finished stage, after an error it would keep the stage waiting for an exit. The
    # stage ends this process group (engine processes included) when it closes.
    status = 0
    try:
        serve(read_settings(args.settings), sys.stdin, protocol)
    except BaseException:  # noqa: BLE001 - reported in the log the stage shows, then the exit status says it
        traceback.print_exc()
        status = 1
    protocol.close()
    sys.stderr.flush()
    os._exit(status)


def _say(protocol: Any, message: dict[str, Any]) -> None:
    protocol.write(json.dumps(message) + "\n")
    protocol.flush()


def _read(path: str | Path, schema: pa.Schema) -> list[dict[str, Any]]:
    table = pq.read_table(path)
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise ValueError(f"{path} lacks columns {missing}; expected {schema.names}")
    return table.select(schema.names).cast(schema).to_pylist()


def _write_atomic(path: str | Path, table: pa.Table) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
