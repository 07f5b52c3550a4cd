"""How far bf16 logits move log pi(y|x): the chunked log-probs round each chunk's lm_head output to bf16
before the float32 log-softmax (moplex_core.lm.logprobs._target_logprobs). Prints one table.

    PYTHONPATH=. python benchmarks/bf16_logits.py [--pairs 60]

The tiny offline Qwen3 (pre-trained 40 steps on `tiny_pairs`) runs in bf16; its bf16 hidden states at
the response positions go through the output layer twice, as the chunked log-probs do (a bf16 matmul,
then float32) and in float32 (the same bf16 operands, a float32 matmul). The output layer's weight is
scaled so that the logits reach a real model's sizes (Qwen3's reach 20-30), since the tiny model's stay
below 7: a row per scale, the error per response token and per response in nats, and what that is in
r = beta (log pi - log pi_ref) at beta = 0.1 (the error of one log-prob; pi and pi_ref each carry one),
and, for a 512-token response, the rms per token times sqrt(512): the size of a sum of 512 errors that
add as independent ones do (their signs vary; the per-response column shows them partly cancelling).
CPU only; a GPU's bf16 matmul rounds its float32 accumulator to bf16 the same way.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from moplex_core.lm.loading import load_model, load_tokenizer
from moplex_core.lm.logprobs import _response_hidden
from moplex_core.lm.tiny import build_tiny_model, tiny_pairs
from moplex_core.lm.tokenize import pad_batch, tokenize_responses

SCALES = (1, 4, 8, 16)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float32 log softmax(logits)[target] per row: [n]."""
    logits = logits.float()
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=60, help="(prompt, response) rows scored (default 60)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_tiny_model(Path(tmp) / "tiny", tiny_pairs(), pretrain_steps=40)
        tokenizer = load_tokenizer(directory)
        model = load_model(directory, dtype=torch.bfloat16, device="cpu")
    pairs = tiny_pairs(args.pairs, seed=1)
    batch = pad_batch([tokenize_responses(tokenizer, p, [r])[0] for p, r in pairs], tokenizer.pad_token_id)
    with torch.no_grad():
        hidden, targets, at, head = _response_hidden(model, batch.input_ids, batch.attention_mask,
                                                     batch.response_mask, None, None)  # [N, d] bf16, [N]
        tokens = torch.bincount(at.rows, minlength=len(pairs)).float()  # [B] response tokens (EOS included)
        print(f"tiny Qwen3 in bf16, {len(pairs)} responses, {int(tokens.sum())} response tokens "
              f"({tokens.mean():.1f} a response)\n")
        print("| weight scale | max abs logit | mean abs error per token (nats) | mean abs error per response "
              "| max per response | r at beta = 0.1, mean | 512 tokens: rms x sqrt(512) | in r at beta = 0.1 |")
        print("|---|---|---|---|---|---|---|---|")
        for scale in SCALES:
            weight = head.weight * scale  # [V, d] bf16
            exact = token_logprobs(torch.nn.functional.linear(hidden.float(), weight.float()), targets)  # [N]
            rounded = token_logprobs(torch.nn.functional.linear(hidden, weight), targets)  # bf16 logits
            error = (rounded - exact).abs()  # [N]
            per_response = torch.zeros(len(pairs)).index_add(0, at.rows, rounded - exact).abs()  # [B]
            long = error.square().mean().sqrt().item() * 512 ** 0.5
            peak = torch.nn.functional.linear(hidden.float(), weight.float()).abs().max().item()
            print(f"| {scale} | {peak:.1f} | {error.mean():.4f} | {per_response.mean():.4f} | "
                  f"{per_response.max():.4f} | {0.1 * per_response.mean():.5f} | {long:.2f} | {0.1 * long:.3f} |")


if __name__ == "__main__":
    main()
