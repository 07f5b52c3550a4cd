"""The parent side of the ``vllm`` backend: render prompts, run the worker, read its shards back.

`VLLMGenerator` starts moplex_core/generate/vllm_worker.py once, under ``python`` (the vLLM
environment's interpreter), and keeps it for every `sample` call, so the model loads once per
stage run. Each call writes a request shard into a private exchange folder, sends its path on the
worker's stdin and waits for the worker to name the response shard (the protocol is in
vllm_worker's docstring). The worker's stderr goes to ``worker.log`` in that folder; when the
worker dies, the error gives its exit status and the end of that log, and the folder is kept.

The worker leads its own process group, and every way out of it ends that whole group: vLLM starts
an engine process (``VLLM::EngineCore``) that holds the GPU memory and, forked, a copy of the
protocol pipe, so ending the worker alone could leave the memory taken and the parent waiting on a
pipe that never closes. The parent therefore watches the worker itself while it waits for a line,
not only the pipe, and with ``timeout_s`` (augment.vllm_timeout_s) ends the group when no line
came in that long: loading, then each call's answer (the worker sends nothing during a call). On Linux the worker also gets SIGTERM when the thread that started it ends, however
it ends (`moplex_core.processes`): moplex killed outright, or its Prefect flow run cancelled (Prefect
signals the flow run's process group, which the worker has left).

Prompts are rendered here with moplex_core.lm.tokenize.encode_prompt, so the worker generates from
exactly the prompt tokens the hf backend and the cache stage use.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from transformers import GenerationConfig, PreTrainedTokenizerBase

from moplex_core.generate import vllm_worker
from moplex_core.generate.base import Sample, SampleRequest, request_prompt_ids, stop_token_ids
from moplex_core.lm.checks import context_length
from moplex_core.lm.loading import hub_snapshot, load_config, load_tokenizer
from moplex_core.processes import popen_ending_with_this_thread

WORKER = Path(vllm_worker.__file__)
# Run the worker by path with the exchange folder as the working directory: as a script, its own
# folder would come first on sys.path, and a module there could shadow an installed package.
_LAUNCH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
_LOG_TAIL = 3000
_POLL_S = 0.5  # how often a wait for a protocol line checks that the worker is still running
_CLOSE_S = 120.0  # how long a clean close waits for the worker to finish and exit
_TERM_S = 10.0  # how long an aborting close waits after SIGTERM before SIGKILL


FINISH_REASONS = ("stop", "length")  # vLLM's for a completion that ended: EOS or a stop string, or max_tokens


def _misanswered(requests: Sequence[SampleRequest], rows: list[dict[str, Any]]) -> str | None:
    """What is wrong with a worker's response rows for ``requests`` (one row per key, n samples each,
    with a token count and a finish reason of FINISH_REASONS each), or None."""
    wanted = {r.key: r.n for r in requests}
    keys = [row["key"] for row in rows]
    if sorted(keys) != sorted(wanted):
        extra, missing = sorted(set(keys) - set(wanted)), sorted(set(wanted) - set(keys))
        twice = sorted({k for k in keys if keys.count(k) > 1})
        return f"keys not asked for {extra[:5]}, missing {missing[:5]}, repeated {twice[:5]}"
    for row in rows:
        n = wanted[row["key"]]
        lengths = {len(row[c]) for c in ("texts", "token_counts", "finish_reasons")}
        if lengths != {n}:
            return f"{row['key']!r}: {n} samples asked for, texts / token counts / finish reasons of lengths " + \
                f"{[len(row[c]) for c in ('texts', 'token_counts', 'finish_reasons')]}"
        unknown = sorted(set(row["finish_reasons"]) - set(FINISH_REASONS))
        if unknown:
            return f"{row['key']!r}: finish reasons {unknown} (a completion that did not end: {FINISH_REASONS} expected)"
    return None


def request_rows(
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[SampleRequest],
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """vllm_worker.REQUEST_SCHEMA rows: each prompt rendered to token ids as the hf backend does."""
    return [
        {
            "key": r.key,
            "prompt": r.prompt,
            "prompt_token_ids": request_prompt_ids(tokenizer, r, use_chat_template=use_chat_template,
                                                   max_prompt_tokens=max_prompt_tokens),
            "n": r.n,
            "seed": r.seed,
        }
        for r in requests
    ]


def _stop_token_ids(model: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """`stop_token_ids` of the model at ``model``: its generation config's EOS, from config.json when it
    has no generation_config.json (as transformers builds a loaded model's, which the hf backend reads)."""
    try:
        generation = GenerationConfig.from_pretrained(model)
    except OSError:  # the model has no generation_config.json
        generation = GenerationConfig.from_model_config(load_config(model))
    return stop_token_ids(tokenizer, generation.eos_token_id)


class VLLMWorkerError(RuntimeError):
    """The vLLM worker could not start, died, or broke the protocol."""


def served_context(model: str, max_model_len: int | None) -> int | None:
    """The positions vLLM serves ``model`` with: its context (with a YaRN factor, as vLLM reads it), or
    ``max_model_len`` (augment.vllm_max_model_len) where that is fewer; None where neither is known."""
    known = [n for n in (context_length(load_config(model).get_text_config()), max_model_len) if n is not None]
    return min(known) if known else None


def refuse_prompts_beyond_the_context(lengths: Sequence[tuple[str, int]], context: int | None,
                                      max_new_tokens: int) -> None:
    """Refuse (ValueError, naming how many and the first) prompts of these (key, prompt tokens as
    generated) pairs with at least the ``context`` positions vLLM serves (`served_context`): vLLM refuses such a prompt, and
    its engine then aborts every request of the call, so the worker would exit and the shard fail on
    every resume. `augment.check_prompts` asks it of every prompt before a shard."""
    long = [(key, n) for key, n in lengths if context is not None and n >= context]
    if long:
        key, tokens = long[0]
        raise ValueError(f"{len(long)} prompt(s) have at least the {context} positions vLLM serves the model with "
                         "(its context, or augment.vllm_max_model_len where fewer) "
                         f"(e.g. {key!r}: {tokens} tokens), which vLLM refuses; set augment.max_prompt_tokens "
                         f"(e.g. {max(1, context - max_new_tokens)}) to keep their last tokens")


class VLLMGenerator:
    backend = "vllm"

    def __init__(
        self,
        model: str,
        *,
        python: str,
        temperature: float = 2.0,
        top_p: float = 1.0,
        max_new_tokens: int = 512,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        use_chat_template: bool = True,
        max_prompt_tokens: int | None = None,
        timeout_s: float | None = None,
        worker: str | Path = WORKER,
    ):
        self.model = model
        # the worker starts in its exchange folder: a relative interpreter path must not be read from there
        self.python = os.path.abspath(python) if os.sep in python else python
        self.worker = Path(worker)
        self.use_chat_template = use_chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self.timeout_s = timeout_s  # for loading, then for each call's answer (augment.vllm_timeout_s)
        if shutil.which(self.python) is None:
            raise VLLMWorkerError(
                f"could not start the vLLM worker with vllm_python={python!r} (no such executable); set vllm_python "
                "to the python of an environment with vllm and pyarrow installed"
            )
        self._tokenizer = load_tokenizer(model)
        self.context = served_context(model, max_model_len)
        self.exchange = Path(tempfile.mkdtemp(prefix="moplex-vllm-"))
        snapshot = hub_snapshot(model)  # a cached hub model: the commit its fingerprint names
        self.settings = {
            "model": model, "revision": snapshot.name if snapshot is not None else None, "dtype": dtype, "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
            "temperature": temperature, "top_p": top_p,
            "max_tokens": max_new_tokens, "stop_token_ids": _stop_token_ids(model, self._tokenizer),
        }
        (self.exchange / "settings.json").write_text(json.dumps(self.settings, indent=2))
        self._log = open(self.exchange / "worker.log", "wb")  # noqa: SIM115 - open for the worker's lifetime
        self._process = popen_ending_with_this_thread(  # ends with moplex, however moplex ends
            [self.python, "-c", _LAUNCH, str(self.worker), "--settings", "settings.json"],
            cwd=self.exchange, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            process_group=0,  # its own group: see the module docstring
        )
        self._pending = b""  # bytes read from the worker's stdout after the last whole line
        self._ready = False
        self._failed = False  # a VLLMWorkerError was raised: close() must not raise it again
        self._closed = False
        self._calls = 0

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        if not requests:
            return []
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys) or min(r.n for r in requests) < 1:
            raise ValueError(f"requests need distinct keys and n >= 1 each (keys {keys[:5]}, n "
                             f"{[r.n for r in requests][:5]}); the worker answers one row per key")
        rows = request_rows(self._tokenizer, requests, self.use_chat_template, self.max_prompt_tokens)
        refuse_prompts_beyond_the_context([(row["key"], len(row["prompt_token_ids"])) for row in rows], self.context,
                                          self.settings["max_tokens"])
        if not self._ready:
            self._expect("ready")  # the first call waits for the model to load
            self._ready = True
        requests_path = self.exchange / f"requests-{self._calls:05d}.parquet"
        responses_path = self.exchange / f"responses-{self._calls:05d}.parquet"
        self._calls += 1
        vllm_worker.write_requests(requests_path, rows)
        self._send({"requests": str(requests_path), "responses": str(responses_path)})
        self._expect("responses", str(responses_path))
        rows = vllm_worker.read_responses(responses_path)
        wrong = _misanswered(requests, rows)
        if wrong:
            raise self._died(self._stop(signal.SIGKILL, 0), f"after answering {responses_path} wrongly: {wrong}")
        requests_path.unlink()
        responses_path.unlink()
        by_key = {row["key"]: row for row in rows}
        return [
            # "length": max_tokens cut it (a vLLM that checks the cap before EOS also says so of an EOS
            # drawn as the last allowed token, which the cache then scores without it: rare)
            [Sample(text, count, finished=reason == "stop")
             for text, count, reason in zip(by_key[r.key]["texts"], by_key[r.key]["token_counts"],
                                            by_key[r.key]["finish_reasons"], strict=True)]
            for r in requests
        ]

    def close(self, failed: bool = False) -> None:
        """End the worker and check that it exited cleanly: at the end of its input it finishes the
        shard in hand and exits. When the stage is failing (``failed``, Ctrl-C included) or a worker
        failure was already reported, end its process group at once instead (SIGTERM, then SIGKILL).
        The exchange folder is kept only where the worker failed, for its log, which the error names;
        otherwise (a clean close, or a stage failing for another reason) it is removed."""
        if self._closed:
            return
        self._closed = True
        aborting = failed or self._failed
        if not aborting:
            with contextlib.suppress(BrokenPipeError):
                self._stdin().close()
        try:
            status = self._stop(signal.SIGTERM, _TERM_S) if aborting else self._stop(None, _CLOSE_S)
        except BaseException:  # Ctrl-C while waiting: what the worker started must not outlive it
            self._signal_group(signal.SIGKILL)
            self._process.wait()
            self._release()
            raise
        error = None if aborting or status == 0 else self._died(status, "while shutting down")
        self._release()
        if error is not None:
            raise error

    def _release(self) -> None:
        """Close the log and both pipes (the worker has exited) and remove the exchange folder unless
        the worker failed."""
        self._log.close()
        for pipe in (self._process.stdin, self._process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        self._remove_exchange_unless_failed()

    def _remove_exchange_unless_failed(self) -> None:
        if not self._failed:  # else a VLLMWorkerError named the log in it
            shutil.rmtree(self.exchange, ignore_errors=True)

    def _stdin(self) -> IO[bytes]:
        return self._process.stdin  # type: ignore[return-value]

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._stdin().write((json.dumps(message) + "\n").encode())
            self._stdin().flush()
        except BrokenPipeError:
            raise self._died(self._stop(None, _TERM_S), "before it read a request") from None

    def _expect(self, field: str, value: Any = None) -> dict[str, Any]:
        """The worker's next line: a JSON object with ``field`` (equal to ``value`` when given)."""
        try:
            line = self._read_line()
        except TimeoutError:
            raise self._died(self._stop(signal.SIGTERM, _TERM_S),
                             f"after waiting augment.vllm_timeout_s = {self.timeout_s:g} s for it to send {field!r} "
                             "(it was ended; raise the setting if loading or a shard takes longer)") from None
        if line is None:
            raise self._died(self._stop(None, _TERM_S), f"before it sent {field!r}")
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            message = None
        if not isinstance(message, dict) or field not in message or (value is not None and message[field] != value):
            text = line.decode(errors="replace").strip()[:200]
            wanted = field if value is None else f"{field} = {value}"
            raise self._died(self._stop(signal.SIGKILL, 0), f"after an unexpected line {text!r} (wanted {wanted!r})")
        return message

    def _read_line(self) -> bytes | None:
        """The worker's next protocol line, or None once it has exited (or closed its stdout) without
        one; TimeoutError when none came in ``timeout_s``. The worker's exit is noticed even while a
        process it started still holds the pipe."""
        fd = self._process.stdout.fileno()  # type: ignore[union-attr]
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while b"\n" not in self._pending:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            exited = self._exited()  # before the poll: what it wrote before exiting is then readable
            readable = poller.poll(0 if exited else _POLL_S * 1000)  # POLLIN, or POLLHUP once the pipe is closed
            if readable:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self._pending += chunk
                    continue
            if exited or readable:  # the worker is gone, or the pipe is closed
                return None
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _exited(self) -> bool:
        """Whether the worker has exited, without reaping it: until it is reaped its pid stays its
        process group's id, so `_stop` cannot signal a group that reused the number."""
        if self._process.returncode is not None:
            return True
        return os.waitid(os.P_PID, self._process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def _stop(self, first: signal.Signals | None, grace_s: float) -> int:
        """Send ``first`` (if any) to the worker's process group, give the worker ``grace_s`` seconds
        to exit, SIGKILL whatever is left of the group (the worker, vLLM's engine processes) and
        return the worker's exit status."""
        if first is not None:  # the group, even after the worker's exit: what it started may outlive it
            self._signal_group(first)
        deadline = time.monotonic() + grace_s
        while not self._exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        if first is not signal.SIGKILL:
            self._signal_group(signal.SIGKILL)
        return self._process.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._process.returncode is None:  # not reaped yet: the group id is still the worker's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, sig)

    def _died(self, status: int, when: str) -> VLLMWorkerError:
        self._failed = True
        self._log.flush()
        log_path = self.exchange / "worker.log"
        tail = log_path.read_text(errors="replace")[-_LOG_TAIL:] if log_path.exists() else ""
        hint = ""
        if "No module named 'vllm'" in tail:
            hint = (f" The interpreter {self.python!r} has no vllm: set vllm_python to the python of an "
                    "environment with vllm and pyarrow installed.")
        elif "No module named 'pyarrow'" in tail:
            hint = f" The interpreter {self.python!r} has no pyarrow: install it beside vllm."
        return VLLMWorkerError(
            f"the vLLM worker ({self.worker}) exited with status {status} {when}.{hint} Its log is "
            f"{log_path}; it ends with:\n{tail}"
        )
