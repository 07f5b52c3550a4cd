"""Scores of responses from a few exact anchors: first-order estimation (paper Algorithm 1, DESIGN 5.4).

For one example with m' responses sharing one prompt, the input embeddings h(x, y_j) and h(x, y_i)
differ only at response positions. Positions are aligned from the response start and cut at the
shorter response (paper, after eq. 3). A response enters log pi(y|x) twice: as the inputs (the
contexts) and as the targets, the token each context scores. The first-order term of y_i -> y_j
takes the inputs to first order, as the paper does, and the targets exactly at y_i's contexts (the
softmax's normaliser depends on the context only, so a target's change is a difference of two
log-probs there, the target term u, computed in the anchor's own pass, `anchor_pass`'s alternatives):

    s_pi[i][j] = <grad_h log pi(y_i|x), h(x, y_j) - h(x, y_i)>
                 + sum_{t < min(n_i, n_j)} log pi(y_j[t] | x, y_i[:t]) - log pi(y_i[t] | x, y_i[:t])

for pi = pi_c (s_c, anchor i, any j) and pi = pi_ref (s_ref, cached once: pi_ref is fixed). The
paper's Algorithm 1 has the input term alone; on the tiny model the target term removes most of its
error (`moplex experiment approximation` reports both; docs/lm-path.md, docs/design-changes.md 5.4). With
delta_c(y) = log pi_c(y|x) - log pi_ref(y|x):

    delta mode:  delta_hat_c(y_j) = mean_{i in anchors} ( delta_c(y_i) + s_c[i][j] - s_ref[i][j] )
    logpi mode:  delta_hat_c(y_j) = mean_{i in anchors} ( log pi_c(y_i) + s_c[i][j] ) - log pi_ref(y_j)

and r_hat = beta * delta_hat. ``delta`` linearises the log-ratio (small and smooth near the
reference); ``logpi`` linearises log pi_c alone and adds the exact cached log pi_ref, as the
authors' released code does. Anchors keep their exact delta (with its autograd graph, for the
M-step); estimated entries are constants.

Both modes are the anchors' mean delta plus an offset that depends on the anchors only through
their first-order terms (their input gradients and target terms):

    delta_hat_c(y_j) = mean_{i in anchors} delta_c(y_i) + o_c[j]
    delta mode:  o_c[j] = mean_i ( s_c[i][j] - s_ref[i][j] )
    logpi mode:  o_c[j] = mean_i ( log pi_ref(y_i) + s_c[i][j] ) - log pi_ref(y_j)

The E-step computes both at its parameters (`estimate_offsets`, `apply_offsets`). The next M-step,
which starts from the same parameters on the same anchors, holds the E-step's estimates as constants
and recomputes only the anchors' exact deltas, with their graph (`hold_estimates`): it needs no
input-gradient pass of its own (DESIGN 5.4's pass count), and its gradient is the gradient of the
objective it computes. (Estimates that followed the anchors' current mean delta without its gradient,
a reading of the paper's "we do not backpropagate gradients on the outputs estimated by gradients",
would shift with the anchors while the gradient ignores the shift: at a = 1 that objective is
constant in the parameters, the slate moving as one, yet its gradient moves the anchor's delta
without end.)

The contraction never forms a [L, V] product: the embedding rows of y_j are gathered ([T, d]) and
multiplied elementwise with the anchor's gradient ([T, d]); the target terms gather m' logits per
position from the [chunk, V] logits the anchor's own log-probs already compute.

Anchors are drawn per example from a generator seeded by (seed, round, example_id), never by batch
composition or call order; the scorer (moplex_core.scorers.lora_policy) gives the E-step of EM
iteration t and the M-step of iteration t + 1 the same round, t + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Literal

import numpy as np
import torch
from peft import PeftModel
from transformers import PreTrainedModel

from moplex_core.lm.device import HostCopies, to_device
from moplex_core.lm.logprobs import PromptPrefix, embed, prefix_is_exact, prompt_prefix, sequence_logprobs
from moplex_core.lm.tokenize import TokenizedResponse, pad_batch
from moplex_core.hashing import seed_from

EstimationMode = Literal["delta", "logpi"]
RowRoute = Callable[[Sequence[int]], AbstractContextManager[Any]]
"""route(rows): the context (e.g. a MultiLoRA route) of a forward over those rows of a batch."""
ESTIMATION_MODES: tuple[str, ...] = ("delta", "logpi")
AnchorWeighting = Literal["mean", "nearest"]
ANCHOR_WEIGHTINGS: tuple[str, ...] = ("mean", "nearest")
AnchorDraw = Literal["uniform", "by_length"]
ANCHOR_DRAWS: tuple[str, ...] = ("uniform", "by_length")


def anchor_indices(example_id: str, n_responses: int, a: int | None, seed: int, iteration: int,
                   lengths: Sequence[int] | None = None) -> np.ndarray:
    """Sorted indices of the anchors of one example: int64 [min(a, n_responses)].

    ``a = None`` or ``a >= n_responses`` takes every response (full computation). Without
    ``lengths`` the a anchors are a uniform draw (the paper's). With ``lengths`` (the responses'
    token counts, [n_responses]) the responses sorted by length (equal lengths in a seeded random
    order, not by index: responses cut at one length cap are many, and the originals come first) are
    cut into a strata of sizes differing by at most one and one anchor is drawn from each, so that
    every length class has an anchor near it: the first-order term stops at the shorter of anchor and
    response (`contraction`), and a response longer than its anchor keeps none of its tail in its
    estimate. ``a = 1`` draws as without lengths (one stratum). The draw depends only on (seed,
    iteration, example_id) and the lengths, never on batch composition or call order.
    """
    if a is None or a >= n_responses:
        return np.arange(n_responses, dtype=np.int64)
    if a < 1:
        raise ValueError(f"the number of anchors must be at least 1, got {a}")
    example_key = seed_from(example_id)
    rng = np.random.default_rng([seed, iteration, example_key])
    if lengths is None or a == 1:
        return np.sort(rng.choice(n_responses, size=a, replace=False)).astype(np.int64)
    if len(lengths) != n_responses:
        raise ValueError(f"{len(lengths)} lengths for {n_responses} responses")
    by_length = np.lexsort((rng.permutation(n_responses), np.asarray(lengths)))  # [n_responses]
    strata = np.array_split(by_length, a)
    return np.sort([stratum[rng.integers(len(stratum))] for stratum in strata]).astype(np.int64)


@dataclass
class AnchorPass:
    """log pi(y_i|x) of anchor rows and, when asked, d log pi / d h at their response positions and
    the target terms u[i][j] of the responses given as their alternatives (module docstring)."""

    logp: torch.Tensor  # float64 [R] on the model's device; carries the parameters' graph when they require grad
    input_grads: torch.Tensor | None  # float32 [R, T, d] on the model's device, t = 0 at the response start
    lengths: torch.Tensor  # int64 [R] response tokens (EOS included)
    target_terms: torch.Tensor | None = None  # float64 [R, K] on the model's device: u[i][j] of row i's alternatives

    def first_order(self, rows: slice, anchor_idx: torch.Tensor, emb: torch.Tensor, lengths: torch.Tensor
                    ) -> torch.Tensor:
        """s[i][j] of the anchors in ``rows`` (one example's, which are its responses ``anchor_idx``,
        given that example's responses as their alternatives) with every response j: float64 [a, M],
        the `contraction` plus the target terms. emb, lengths: `response_embeddings` of the example."""
        s = contraction(self.input_grads[rows], anchor_idx, emb, lengths)  # [a, M]
        return s + self.target_terms[rows, : s.shape[1]]


def anchor_pass(
    model: PreTrainedModel | PeftModel,
    sequences: Sequence[TokenizedResponse],
    pad_token_id: int,
    *,
    input_grads: bool,
    keep_graph: bool = False,
    chunk_size: int = 1024,
    groups: Sequence[Hashable] | None = None,
    route: RowRoute | None = None,
    alternatives: Sequence[Sequence[TokenizedResponse]] | None = None,
) -> AnchorPass:
    """The log-probs of ``sequences`` in one forward (two with shared prompts: the prompts, then the
    rows' continuations).

    input_grads: also take grad_h log pi(y|x) w.r.t. the input embeddings at the response positions
                 (torch.autograd.grad on the embeddings only; no parameter's .grad is touched).
    keep_graph:  keep the autograd graph so that the caller can backpropagate into the (LoRA)
                 parameters through ``logp`` afterwards (M-step).
    groups:      one key per row; rows with equal keys share one pass over their prompt
                 (moplex_core.lm.logprobs.prompt_prefix): they must have the same prompt tokens
                 (checked) and, under ``route``, the same adapter (the caller's promise). Every row
                 runs whole when None, when a prompt is one token long, or when the model has layers
                 other than full attention (`prefix_is_exact`).
    route:       the adapters of each forward (`RowRoute`); None: the model as it is (the base model,
                 or, without ``groups``, whatever route the caller has entered: the prompt pass has
                 fewer rows than such a route).
    alternatives: per row, the responses whose tokens its contexts also score (its example's
                 responses, in order): ``target_terms`` [R, K], K the most a row has, 0 past a row's own.

    With ``groups``, the prompt pass keeps its graph only for ``keep_graph``: the input gradients
    are taken at response positions, which the prompt's keys and values do not depend on.
    """
    route = route or (lambda rows: nullcontext())
    prefix: PromptPrefix | None = None
    if groups is not None and len(groups) != len(sequences):
        raise ValueError(f"groups has {len(groups)} keys for {len(sequences)} rows; give one per row")
    if groups is not None and min(s.response_start for s in sequences) >= 2 and prefix_is_exact(model):
        prefixes, firsts, local = _prompt_groups(sequences, groups)
        with torch.set_grad_enabled(keep_graph), route(firsts):
            prefix = prompt_prefix(model, prefixes, local, pad_token_id)
        # each row continues its prefix from its last prompt token, which predicts its first response token
        sequences = [TokenizedResponse(s.input_ids[s.response_start - 1 :], response_start=1) for s in sequences]
    batch = pad_batch(sequences, pad_token_id)
    device = next(model.parameters()).device
    input_ids = to_device(batch.input_ids, device)
    embeds = embed(model, input_ids).detach()  # [R, L, d]
    if input_grads:
        embeds.requires_grad_(True)
    starts = torch.tensor([s.response_start for s in sequences], dtype=torch.long)
    lengths = torch.tensor([len(s.input_ids) - s.response_start for s in sequences], dtype=torch.long)
    others = None if alternatives is None else _alternative_tokens(lengths, alternatives)  # [N, K]
    with torch.set_grad_enabled(input_grads or keep_graph), route(range(len(sequences))):
        scored = sequence_logprobs(model, input_ids, batch.attention_mask, batch.response_mask, inputs_embeds=embeds,
                                   prefix=prefix, chunk_size=chunk_size, alternatives=others)
        logp, target_terms = (scored, None) if others is None else (scored[0], scored[1].double())  # [R], [R, K]
        logp = logp.to(torch.float64)  # [R], in the graph when it is taken
    grads = None
    if input_grads:
        (full,) = torch.autograd.grad(logp.sum(), embeds, retain_graph=keep_graph)  # [R, L, d]
        grads = _response_rows(full.float(), starts, lengths)
    return AnchorPass(logp if keep_graph else logp.detach(), grads, lengths, target_terms)


def _alternative_tokens(lengths: torch.Tensor, alternatives: Sequence[Sequence[TokenizedResponse]]) -> torch.Tensor:
    """`sequence_logprobs`' alternatives: int64 [N, K] on the CPU, the response tokens of row b's
    alternatives at each of its ``lengths[b]`` response positions (-1 past an alternative's end)."""
    if len(alternatives) != len(lengths):
        raise ValueError(f"alternatives has {len(alternatives)} entries for {len(lengths)} rows; give one per row")
    width = max(len(responses) for responses in alternatives)
    tables: dict[int, torch.Tensor] = {}  # per distinct alternatives (an example's rows share one): [T, K]
    blocks = []
    for n, responses in zip(lengths.tolist(), alternatives, strict=True):
        if id(responses) not in tables:
            tokens = [r.input_ids[r.response_start :] for r in responses]
            table = torch.full((max(map(len, tokens)), width), -1, dtype=torch.long)  # [T, K]
            for k, row in enumerate(tokens):
                table[: len(row), k] = torch.tensor(row, dtype=torch.long)
            tables[id(responses)] = table
        table = tables[id(responses)]
        blocks.append(torch.nn.functional.pad(table[:n], (0, 0, 0, max(0, n - table.shape[0])), value=-1))  # [n, K]
    return torch.cat(blocks)


def _prompt_groups(sequences: Sequence[TokenizedResponse], groups: Sequence[Hashable]
                   ) -> tuple[list[list[int]], list[int], torch.Tensor]:
    """(each group's prompt but its last token [G], each group's first row [G], each row's group
    int64 [R]), groups in order of first appearance."""
    first: dict[Hashable, int] = {}
    for row, key in enumerate(groups):
        first.setdefault(key, row)
        head, seq = sequences[first[key]], sequences[row]
        if seq.input_ids[: seq.response_start] != head.input_ids[: head.response_start]:
            raise ValueError(f"rows {first[key]} and {row} are in group {key!r} but their prompt tokens differ")
    index = {key: g for g, key in enumerate(first)}
    prefixes = [sequences[row].input_ids[: sequences[row].response_start - 1] for row in first.values()]
    return prefixes, list(first.values()), torch.tensor([index[key] for key in groups], dtype=torch.long)


def response_embeddings(
    model: PreTrainedModel | PeftModel, sequences: Sequence[TokenizedResponse]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input embeddings of every response of one example at its response positions.

    Returns (float32 [M, T, d] on the model's device, zero past each response's end; int64 [M]
    response lengths on the same device).
    """
    device = next(model.parameters()).device
    lengths = torch.tensor([len(s.input_ids) - s.response_start for s in sequences], dtype=torch.long)
    width = int(lengths.max())
    ids = torch.zeros(len(sequences), width, dtype=torch.long)  # [M, T]
    for row, seq in enumerate(sequences):
        ids[row, : lengths[row]] = torch.tensor(seq.input_ids[seq.response_start :], dtype=torch.long)
    ids, lengths = to_device(ids, device), to_device(lengths, device)
    with torch.no_grad():
        emb = embed(model, ids).float()  # [M, T, d]
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]  # [M, T]
    return emb * valid[..., None], lengths


def contraction(
    anchor_grads: torch.Tensor, anchor_idx: torch.Tensor, emb: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """s[i][j] = sum_{t < min(n_i, n_j)} <g_i[t], e_j[t] - e_i[t]> for one example: float64 [a, M].

    anchor_grads: float32 [a, T_a, d]  grad_h log pi(y_i|x) of each anchor at its response positions
    anchor_idx:   int64 [a]            which responses the anchors are
    emb:          float32 [M, T, d]    input embeddings of all responses (response_embeddings)
    lengths:      int64 [M]            response lengths
    All on one device (the model's: no [a, T, d] tensor crosses to the CPU); the result is there too.
    """
    width = min(anchor_grads.shape[1], emb.shape[1])
    g = anchor_grads[:, :width]  # [a, T, d]
    e = emb[:, :width]  # [M, T, d]
    cross = torch.einsum("atd,mtd->amt", g, e)  # [a, M, T]: <g_i[t], e_j[t]>, a batched matmul over t
    own = (g * e[anchor_idx]).sum(-1)  # [a, T]: <g_i[t], e_i[t]>
    cut = torch.minimum(lengths[anchor_idx][:, None], lengths[None, :])  # [a, M]
    aligned = torch.arange(width, device=g.device)[None, None, :] < cut[..., None]  # [a, M, T]
    return torch.where(aligned, cross - own[:, None, :], 0.0).sum(-1).to(torch.float64)


def response_distances(anchor_idx: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """||h(x, y_j) - h(x, y_i)|| over every response position of one example: float64 [a, M] for the
    anchors i in ``anchor_idx`` [a] and every response j. emb: `response_embeddings` of the example,
    float32 [M, T, d], zero past each response's end, so a position only one of the two responses has
    counts in full: the first-order term stops at the shorter response, and is blind there."""
    return torch.cdist(emb[anchor_idx].flatten(1).double(), emb.flatten(1).double())


def nearest_anchor_weights(anchor_idx: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """The ``nearest`` weighting of one example: float64 [a, M] on emb's device, column j all on the
    anchor closest to y_j in input embedding space (the first of equally close ones), where the
    first-order estimate is most accurate (its error grows with the distance: paper Table 1, and
    the approximation table in docs/lm-path.md).

    emb: `response_embeddings` of the example; the distance is `response_distances`'.
    """
    distances = response_distances(anchor_idx, emb)  # [a, M]
    nearest = distances.argmin(0)  # [M]
    weights = torch.zeros_like(distances)
    return weights.scatter_(0, nearest[None, :], 1.0)


def estimate_offsets(
    mode: EstimationMode,
    anchor_idx: torch.Tensor,
    s_policy: torch.Tensor,
    ref_logp: torch.Tensor,
    s_ref: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_c[j] of the M responses of one example: float64 [M] (module docstring), 0 at the anchors.

    anchor_idx [a]; s_policy float [a, M] (the policy's contraction at the anchors); ref_logp
    float64 [M]; s_ref float [M, M] (the cached reference contraction); weights float64 [a, M] or
    None: how much each anchor's first-order estimate of y_j counts (columns summing to 1,
    `nearest_anchor_weights`), None for their mean (the paper's).
    """
    s_policy = s_policy.detach().to(torch.float64)
    if mode == "delta":
        terms = s_policy - s_ref[anchor_idx].to(torch.float64)  # [a, M]
    elif mode == "logpi":
        terms = ref_logp[anchor_idx, None] + s_policy  # [a, M]
    else:
        raise ValueError(f"estimation mode must be one of {ESTIMATION_MODES}, got {mode!r}")
    offsets = terms.mean(0) if weights is None else (weights.to(terms) * terms).sum(0)  # [M]
    if mode == "logpi":
        offsets = offsets - ref_logp
    return offsets.index_fill(0, anchor_idx, 0.0)


def apply_offsets(anchor_idx: torch.Tensor, anchor_delta: torch.Tensor, offsets: torch.Tensor,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """delta_hat_c of one example: float64 [M]. Anchors keep their exact delta (float64 [a], with its
    graph); every other entry is the constant sum_i w_ij delta_c(y_i) + o_c[j] (mean_i delta_c(y_i)
    for ``weights`` None), with the weights `estimate_offsets` took."""
    held = anchor_delta.detach()
    base = held.mean() if weights is None else (weights.to(held) * held[:, None]).sum(0)  # [] or [M]
    return hold_estimates(anchor_idx, anchor_delta, base + offsets)


def hold_estimates(anchor_idx: torch.Tensor, anchor_delta: torch.Tensor, estimates: torch.Tensor) -> torch.Tensor:
    """delta_hat_c of one example in an M-step: float64 [M], the ``estimates`` (float64 [M], an
    E-step's delta_hat) held as constants, the anchors' entries replaced by their current exact delta
    (float64 [a], with its graph)."""
    return estimates.detach().index_put((anchor_idx,), anchor_delta)


def estimate_delta(
    mode: EstimationMode,
    anchor_idx: torch.Tensor,
    anchor_logp: torch.Tensor,
    s_policy: torch.Tensor | None,
    ref_logp: torch.Tensor,
    s_ref: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """delta_hat_c(y_j) for the M responses of one example: float64 [M] (module docstring).

    anchor_idx [a]; anchor_logp float64 [a] (exact log pi_c, may carry a graph); s_policy float
    [a, M] (None when every response is an anchor); ref_logp float64 [M]; s_ref float [M, M].
    Anchor entries are the exact delta with its graph; every other entry is a constant.
    """
    anchor_delta = anchor_logp - ref_logp[anchor_idx]  # [a]
    m = ref_logp.shape[0]
    if anchor_idx.numel() == m:
        return torch.zeros(m, dtype=torch.float64).index_put((anchor_idx,), anchor_delta)
    offsets = estimate_offsets(mode, anchor_idx, s_policy, ref_logp, s_ref, weights)
    return apply_offsets(anchor_idx, anchor_delta, offsets, weights)


def reference_terms_batch(
    model: PreTrainedModel | PeftModel,
    examples: Sequence[Sequence[TokenizedResponse]],
    pad_token_id: int,
    *,
    rows_per_pass: int = 32,
    chunk_size: int = 1024,
    contractions: bool = True,
    share_prompts: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """What the cache stage stores for each example under pi_ref (the base model; a model with
    `MultiLoRA` adapters outside a route is the same): (ref_logp float64 [M], s_ref float32 [M, M]),
    every response an anchor once, so any later anchor choice finds its row of s_ref. The examples'
    responses go in order through forward + input-gradient passes of at most ``rows_per_pass`` rows
    (an example's rows in one pass share its prompt pass, or with ``share_prompts`` False run whole);
    forward passes only and s_ref None without ``contractions``.

    An example whose responses straddle passes gets its rows of s_ref from each pass: row i of s_ref
    needs only response i's input gradients and every response's embeddings.
    """
    rows = [(e, j) for e, sequences in enumerate(examples) for j in range(len(sequences))]
    ref_logp = [torch.empty(len(sequences), dtype=torch.float64) for sequences in examples]
    s_ref = [torch.empty(len(sequences), len(sequences), dtype=torch.float32) if contractions else None
             for sequences in examples]
    copies, placed = HostCopies(), []  # per (pass, example): its log pi_ref [p] and s_ref rows [p, m'] on the device
    for start in range(0, len(rows), rows_per_pass):
        part = rows[start : start + rows_per_pass]
        ref = anchor_pass(model, [examples[e][j] for e, j in part], pad_token_id, input_grads=contractions,
                          chunk_size=chunk_size, groups=[e for e, _ in part] if share_prompts else None,
                          alternatives=[examples[e] for e, _ in part] if contractions else None)
        first = 0
        for e, members in groupby(part, key=lambda row: row[0]):  # an example's rows in a pass are contiguous
            idx = torch.tensor([j for _, j in members])  # [p]: which of its responses
            end = first + len(idx)
            s = None
            if contractions:
                emb, lengths = response_embeddings(model, examples[e])
                s = ref.first_order(slice(first, end), to_device(idx, emb.device), emb, lengths)
            copies.add((ref.logp[first:end], s))
            placed.append((e, idx))
            first = end
    for (e, idx), (logp, s) in zip(placed, copies.results(), strict=True):
        ref_logp[e][idx] = logp
        if contractions:
            s_ref[e][idx] = s.float()
    return list(zip(ref_logp, s_ref))


def embedding_distance(emb: torch.Tensor, anchor: int, full_norm: torch.Tensor) -> torch.Tensor:
    """||h(x, y_j) - h(x, y_i)|| / ||h(x, y_i)||: float64 [M], the paper's distance of Table 1, over
    every response position (`response_distances`); ``full_norm`` is ||h(x, y_i)|| over the anchor's
    whole prompt + response sequence."""
    return response_distances(torch.tensor([anchor], device=emb.device), emb)[0] / full_norm.double()


def _response_rows(full: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Rows of a [R, L, d] tensor at response positions, left-aligned: [R, T, d], zero past the end.
    ``starts`` and ``lengths`` (int64 [R]) are on the CPU; only the [R, T] index crosses to the device."""
    width = int(lengths.max())
    t = torch.arange(width)[None, :]  # [1, T]
    positions = (starts[:, None] + t.clamp_max(lengths[:, None] - 1)).clamp_max(full.shape[1] - 1)  # [R, T]
    valid, positions = (to_device(x, full.device) for x in (t < lengths[:, None], positions))  # [R, T] each
    rows = torch.gather(full, 1, positions[..., None].expand(-1, -1, full.shape[2]))  # [R, T, d]
    return rows * valid[..., None]


def estimation_gap(estimated: torch.Tensor, exact: torch.Tensor, is_estimated: torch.Tensor,
                   in_slate: torch.Tensor) -> tuple[float, float]:
    """(mean |r_hat - r| over the estimated entries, the mean over (example, cluster) of the std of
    a slate's exact scores): `estimation_error`'s relative error is their ratio. Shapes as there."""
    error = (estimated - exact).abs()[is_estimated]
    slate = in_slate.unsqueeze(1).expand_as(exact)  # [n, k, M]
    count = slate.sum(-1)  # [n, k]
    mean = torch.where(slate, exact, 0.0).sum(-1) / count
    spread = (torch.where(slate, exact - mean.unsqueeze(-1), 0.0).pow(2).sum(-1) / (count - 1).clamp(min=1)).sqrt()
    return float(error.mean()), float(spread.mean())


def check_sample(n: int, size: int, seed: int) -> np.ndarray:
    """The examples (sorted indices into n) an estimation check scores exactly: a seeded draw of
    ``size`` (all when fewer), the same at every EM iteration."""
    return np.sort(np.random.default_rng(seed).choice(n, size=min(size, n), replace=False))


def estimation_error(estimated: torch.Tensor, exact: torch.Tensor, is_estimated: torch.Tensor, in_slate: torch.Tensor,
                     log_likelihood: Callable[[torch.Tensor], torch.Tensor], alpha: torch.Tensor
                     ) -> dict[str, float | None]:
    """How far one E-step's estimated scores are from the exact ones under the same adapters.

    estimated, exact: float64 [n, k, M] scores r; is_estimated: bool [n, k, M] (False at anchors and
    padding); in_slate: bool [n, M]; log_likelihood: scores [n, k, M] -> log P_c(sigma_i) [n, k];
    alpha: float64 [k]. ``relative_error`` is the mean |r_hat - r| over estimated entries divided by
    the spread that orders a slate (the mean over (example, cluster) of the std of its exact
    scores; None when every slate's exact scores are equal): above about 1 the estimates say less
    about an order than their error does.
    ``same_cluster`` is the fraction of rankings whose most probable cluster is the same under both.
    """
    mean_error, mean_spread = estimation_gap(estimated, exact, is_estimated, in_slate)
    joint = {name: torch.log(alpha) + log_likelihood(scores) for name, scores in
             (("estimated", estimated), ("exact", exact))}  # [n, k] each
    return {
        "estimated_entries": int(is_estimated.sum()),
        "mean_abs_error": mean_error,
        "score_spread": mean_spread,
        "relative_error": mean_error / mean_spread if mean_spread > 0 else None,
        "same_cluster": float((joint["estimated"].argmax(1) == joint["exact"].argmax(1)).double().mean()),
        "log_likelihood_estimated": float(torch.logsumexp(joint["estimated"], 1).mean()),
        "log_likelihood_exact": float(torch.logsumexp(joint["exact"], 1).mean()),
    }
