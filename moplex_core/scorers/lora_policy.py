"""k LoRA adapters on one base language model as the k clusters' scorers (DESIGN 5.1, 5.3-5.5).

    r_c(x, y) = beta * (log pi_c(y|x) - log pi_ref(y|x)),   pi_c = base + adapter c,
                                                              pi_ref = base, adapters off

The k adapters live in one batched multi-LoRA layer (moplex_core.lm.multi_lora): one forward serves
rows of every cluster, each routed to its own adapter, and one optimizer holds them all
(moplex_core.lm.routed_adam: AdamW's steps, taken by the adapters each minibatch routed).
log pi_ref of every response and the reference contraction s_ref come from the `cache` artifact
(`PolicyInputs`), so pi_ref is never run here. With ``anchors = a < m'`` the scores of non-anchor
responses are estimated from a anchors per example (moplex_core.estimate, paper Algorithm 1).

Passes per EM iteration t, per example (full computation: a = m'):

    M-step t   one forward + backward into the LoRA weights over the a anchors of every (example,
               cluster) pair with nonzero weight, in minibatches of ``batch_size`` pairs (clusters
               mixed; passes of at most ``score_batch_size`` rows, gradients accumulated, one
               optimizer step per minibatch). A non-anchor score is a constant: the estimate of the
               E-step of iteration t-1 (moplex_core.estimate), which ran at the parameters this
               M-step starts from, on the same anchors, while the anchors' scores are exact at the
               current parameters, with their gradient. So the M-step runs no input-gradient pass of
               its own, and its gradient is that of the objective it computes. The estimates stay at
               the M-step's starting parameters for all its minibatches and epochs (recomputing them
               would cost an input-gradient pass per minibatch). At t = 0 every adapter is the base
               model, so s_c = s_ref and delta_c = 0 at the anchors: the estimates come from the cache
               alone.
    E-step t   one forward + input-gradient pass over the a anchors under each of the k adapters
               (a forward only under full computation, and for an example whose every response is
               an anchor), ``score_batch_size`` rows per pass, clusters mixed; its estimates are
               kept for the M-step of t + 1.

The anchors of round t serve the M-step of t and the E-step of t - 1; they are drawn from
(seed, t, example_id), so they never depend on batching, and a resumed run (the estimates are part of
`state_dict`) repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from moplex_core.em import Rankings
from moplex_core.estimate import (
    ANCHOR_DRAWS,
    ANCHOR_WEIGHTINGS,
    ESTIMATION_MODES,
    AnchorDraw,
    AnchorWeighting,
    EstimationMode,
    anchor_indices,
    anchor_pass,
    apply_offsets,
    check_sample,
    estimate_offsets,
    estimation_gap,
    hold_estimates,
    nearest_anchor_weights,
    response_embeddings,
)
from moplex_core.lm.checkpointing import checkpoint_layers
from moplex_core.lm.device import HostCopies, passes_sized_by, to_device
from moplex_core.lm.loading import load_model
from moplex_core.lm.logprobs import output_score_features
from moplex_core.lm.multi_lora import LoRASettings, MultiLoRA
from moplex_core.lm.routed_adam import RoutedAdam
from moplex_core.lm.tokenize import TokenizedResponse, pad_batch
from moplex_core.pl import LIKELIHOODS, PAD, RankingIndex
from moplex_core.hashing import seed_from

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyInputs:
    """n examples as the `cache` artifact holds them, plus their tiers (M = max m' over examples).

    sequences[i][j] is prompt + response j of example i (originals first, then generated ones).
    Slots j >= m'_i are padding: tier PAD, ref_logp 0, ref_contraction 0. ref_contraction is None
    for a cache without contractions (cache.contractions = false): exact scores only.
    """

    example_ids: tuple[str, ...]
    sequences: tuple[tuple[TokenizedResponse, ...], ...]
    ref_logp: torch.Tensor  # float64 [n, M]: log pi_ref(y_j|x), response tokens incl. EOS
    ref_contraction: torch.Tensor | None  # float32 [n, M, M]: s_ref[i][j]
    tiers: torch.Tensor  # int64 [n, M], codes of moplex_core.pl
    ranked_prefix: torch.Tensor | None = None  # int64 [n]

    def __post_init__(self) -> None:
        n, m = self.tiers.shape
        if not (len(self.example_ids) == len(self.sequences) == n and self.ref_logp.shape == (n, m)
                and (self.ref_contraction is None or self.ref_contraction.shape == (n, m, m))):
            raise ValueError(
                f"PolicyInputs parts disagree: {len(self.example_ids)} ids, {len(self.sequences)} "
                f"sequence lists, ref_logp {tuple(self.ref_logp.shape)}, ref_contraction "
                f"{None if self.ref_contraction is None else tuple(self.ref_contraction.shape)}, tiers "
                f"{tuple(self.tiers.shape)}"
            )
        sizes = [len(s) for s in self.sequences]
        if sizes != (self.tiers != PAD).sum(1).tolist():
            raise ValueError("every example needs exactly one non-PAD tier per response; the cache and "
                             "the rankings it was built from disagree (rebuild the cache)")

    def __len__(self) -> int:
        return len(self.example_ids)

    def slots(self) -> list[tuple[int, int]]:
        """(example i, response j) of every response, in example then response order."""
        return [(i, j) for i, seqs in enumerate(self.sequences) for j in range(len(seqs))]

    def rankings(self, model: str = "pl") -> Rankings:
        """The rankings of these examples under the observation model ``model`` (pl, bt_pairs)."""
        return Rankings(self.tiers, self.ranked_prefix, self.example_ids, model)

    def subset(self, idx: Sequence[int] | np.ndarray | torch.Tensor) -> PolicyInputs:
        idx = torch.as_tensor(np.asarray(idx), dtype=torch.int64)
        rows = idx.tolist()
        width = max((len(self.sequences[i]) for i in rows), default=0)
        return PolicyInputs(
            tuple(self.example_ids[i] for i in rows),
            tuple(self.sequences[i] for i in rows),
            self.ref_logp[idx, :width],
            None if self.ref_contraction is None else self.ref_contraction[idx, :width, :width],
            self.tiers[idx, :width],
            None if self.ranked_prefix is None else self.ranked_prefix[idx],
        )


@dataclass
class ScoreRecord:
    """What one `score` call computed, for scores.parquet."""

    iteration: int
    example_ids: tuple[str, ...]
    scores: torch.Tensor  # float64 [n, k, M]
    is_anchor: torch.Tensor  # bool [n, M] (the same anchors for every cluster)
    in_slate: torch.Tensor  # bool [n, M]
    check_exact: torch.Tensor | None = None  # exact scores [n', k, M'] of the fallback's check examples


@dataclass(frozen=True)
class _EStepEstimates:
    """What an E-step leaves for the next M-step: the deltas its anchors (round ``round``) gave,
    estimated and exact (the M-step recomputes the anchors')."""

    round: int
    inputs: str  # sha256 of the example ids: the estimates belong to these inputs only
    deltas: torch.Tensor  # float64 [n, k, M], 0 at padding


Row = tuple[int, int, int]  # (example in the inputs, cluster, response): one response under one adapter


class LoRAPolicyScorer:
    """The Scorer of moplex_core.em for a language model with k LoRA adapters.

    model_path:        base model directory (or a cached hub name); pi_ref.
    k, beta:           clusters; r = beta * log-ratio.
    anchors:           a per example, None = every response exact (the full-computation ablation).
    estimation:        "delta" or "logpi" (moplex_core.estimate).
    anchor_weighting:  how a non-anchor's estimate combines the anchors' first-order estimates of it:
                       "mean" (the paper's Algorithm 1) or "nearest" (the anchor closest to it in
                       input embedding space alone, `estimate.nearest_anchor_weights`).
    anchor_draw:       "uniform" (the paper's) or "by_length": one anchor from each of a strata of the
                       responses sorted by length (`estimate.anchor_indices`).
    lr, epochs:        Adam learning rate (`RoutedAdam`); passes over the weighted pairs per M-step.
    first_epochs:      passes of the first M-step (iteration 0), None = ``epochs``. It starts with every
                       adapter at the base model and must carry the start's partition into them.
    batch_size:        (example, cluster) pairs per M-step minibatch (a rows each, m' when full).
    score_batch_size:  rows (one response under one adapter) per E-step or exact-scoring pass.
    share_prompts:     run an (example, cluster)'s prompt once per pass for all its rows in that pass
                       (moplex_core.lm.logprobs.prompt_prefix): the same scores and gradients for
                       fewer tokens. With LoRA dropout the prompt's dropout mask is then shared too.
    gradient_checkpointing: every decoder layer keeps only its input for the backward and runs its forward
                       again there (moplex_core.lm.checkpointing): the passes that take gradients hold one
                       layer's activations, for one forward more each and about twice its host time; the
                       same scores and gradients.
    seed:              adapter initialisation (LoRA A), M-step shuffling, anchor draws, LoRA dropout
                       masks and the examples the estimation check and the exact fallback draw.
    exact_fallback:    examples (a seeded draw, `estimate.check_sample`) whose estimated E-step scores
                       are compared with exact ones after every estimated E-step; 0 = never. When the
                       mean error exceeds ``fallback_above`` times the spread of the exact scores (or is
                       not finite), ``fell_back`` records where and how far off and ``anchors`` becomes
                       None: the scores returned are still those estimates, and EM
                       (`em.fit._m_and_e_step`) redoes that iteration's M-step and E-step exactly.
    """

    def __init__(
        self,
        model_path: str | Path,
        k: int,
        *,
        beta: float = 0.1,
        anchors: int | None = None,
        estimation: EstimationMode = "delta",
        anchor_weighting: AnchorWeighting = "mean",
        anchor_draw: AnchorDraw = "uniform",
        lora: LoRASettings = LoRASettings(),
        lr: float = 1e-4,
        epochs: int = 1,
        first_epochs: int | None = None,
        batch_size: int = 16,
        score_batch_size: int = 32,
        chunk_size: int = 1024,
        share_prompts: bool = True,
        gradient_checkpointing: bool = False,
        seed: int = 0,
        exact_fallback: int = 0,
        fallback_above: float = 1.0,
        dtype: str | torch.dtype = torch.float32,
        device: str = "cpu",
        progress: bool = False,
    ) -> None:
        if estimation not in ESTIMATION_MODES:
            raise ValueError(f"estimation must be one of {ESTIMATION_MODES}, got {estimation!r}")
        if anchor_weighting not in ANCHOR_WEIGHTINGS:
            raise ValueError(f"anchor_weighting must be one of {ANCHOR_WEIGHTINGS}, got {anchor_weighting!r}")
        if anchor_draw not in ANCHOR_DRAWS:
            raise ValueError(f"anchor_draw must be one of {ANCHOR_DRAWS}, got {anchor_draw!r}")
        first_epochs = epochs if first_epochs is None else first_epochs
        if k < 1 or beta <= 0 or min(epochs, first_epochs, batch_size, score_batch_size) < 1:
            raise ValueError(f"need k >= 1, beta > 0, epochs, batch sizes >= 1; got k={k}, beta={beta}, "
                             f"epochs={epochs}, first_epochs={first_epochs}, batch_size={batch_size}, "
                             f"score_batch_size={score_batch_size}")
        self.k, self.beta, self._anchors, self.estimation = k, beta, anchors, estimation
        self.anchor_weighting, self.anchor_draw = anchor_weighting, anchor_draw
        self.epochs, self.batch_size, self.score_batch_size = epochs, batch_size, score_batch_size
        self.first_epochs = first_epochs
        self.chunk_size, self.share_prompts, self.seed, self.progress = chunk_size, share_prompts, seed, progress
        self.exact_fallback, self.fallback_above = exact_fallback, fallback_above
        self.fell_back: dict[str, Any] | None = None  # {"iteration", "relative_error"} once estimates failed
        self.adapter_names = [f"c{c}" for c in range(k)]
        self.model = load_model(model_path, dtype=dtype, device=device, progress=progress)
        self.pad_token_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.lora = MultiLoRA(self.model, k, lora, seed)
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            checkpoint_layers(self.model)
        self.model.eval()
        self._lora = self.lora.named_parameters()
        self.lr = lr
        self.optimizer = RoutedAdam(self._lora, k, lr=lr)
        self._shuffle = torch.Generator().manual_seed(seed)
        self._estep: _EStepEstimates | None = None
        self.last_scores: ScoreRecord | None = None
        self.last_fit: dict[str, Any] = {}

    # -- the Scorer protocol -------------------------------------------------------------------

    def score(self, inputs: PolicyInputs, iteration: int = 0, *, check: bool = True) -> torch.Tensor:
        """E-step scores float64 [n, k, M] (estimated for non-anchors when anchors < m'), with the
        anchors of round ``iteration + 1``, whose estimates the next M-step holds; ``check=False``
        skips the exact fallback's check (backtracking's look at the adapters before an M-step)."""
        deltas, is_anchor = self._score_all(inputs, iteration + 1, self.anchors, f"E-step {iteration}")
        scores = self.beta * deltas
        relative, check_exact = (self._estimates_off_by(inputs, scores, is_anchor) if self.exact_fallback and check
                                 else (None, None))
        if relative is not None and not relative <= self.fallback_above:  # NaN falls back too
            finite = math.isfinite(relative)
            log.warning("E-step %d: the anchors' estimates are %s on %d training examples (train.exact_fallback = "
                        "%g); this iteration and every later one compute every response exactly", iteration,
                        f"off by {relative:.2f} times the spread of the exact scores" if finite else "not finite",
                        min(self.exact_fallback, len(inputs)), self.fallback_above)
            self.fell_back = {"iteration": iteration, "relative_error": relative if finite else None}
        self._estep = _EStepEstimates(iteration + 1, _inputs_key(inputs), deltas)
        self.last_scores = ScoreRecord(iteration, inputs.example_ids, scores, is_anchor, inputs.tiers != PAD,
                                       check_exact)
        return scores

    @property
    def anchors(self) -> int | None:
        """a per example, None = every response exact: as configured, until an exact fallback."""
        return None if self.fell_back is not None else self._anchors

    @property
    def estimates(self) -> bool:
        """Whether the E-step's scores are estimated from its iteration's anchors (EM's backtracking
        then compares like with like, `em.fit._m_and_e_step`)."""
        return self.anchors is not None

    def _estimates_off_by(self, inputs: PolicyInputs, scores: torch.Tensor, is_anchor: torch.Tensor
                          ) -> tuple[float | None, torch.Tensor | None]:
        """(mean |r_hat - r| / the spread of the exact scores (`estimate.estimation_gap`), their exact
        scores float64 [n', k, M']) on the fallback's examples; (None, None) when none of their scores
        is estimated, None for the ratio when their spread is 0 or when the exact scores are not finite
        themselves (the adapters diverged: not the estimates' failure, and EM's to handle)."""
        picked = torch.as_tensor(check_sample(len(inputs), self.exact_fallback, self.seed))
        checked = inputs.subset(picked)
        in_slate = checked.tiers != PAD  # [n', M]
        width = in_slate.shape[1]
        estimated = (~is_anchor[picked, :width] & in_slate).unsqueeze(1).expand(-1, self.k, -1)  # [n', k, M]
        if not estimated.any():
            return None, None
        exact = self.exact_scores(checked)
        if not torch.isfinite(exact[in_slate.unsqueeze(1).expand_as(exact)]).all():
            return None, exact
        error, spread = estimation_gap(scores[picked, :, :width], exact, estimated, in_slate)
        return (error / spread if spread > 0 else None), exact

    def exact_scores(self, inputs: PolicyInputs) -> torch.Tensor:
        """Every response exact, float64 [n, k, M] (evaluation, DESIGN 5.4)."""
        return self.beta * self._score_all(inputs, 0, None, "exact scores")[0]

    def exact(self) -> ExactView:
        """This scorer seen through the Scorer protocol with exact scores (em.fit ranks restarts by its
        exact log-likelihood; evaluate_mixture takes it too)."""
        return ExactView(self)

    def reference_gap(self, inputs: PolicyInputs, responses: int | None = None) -> float:
        """max |log pi_ref(y|x) here - the cache's ref_logp| over the first ``responses`` responses
        (``score_batch_size`` by default), in nats, adapters off. Every delta_c starts from it: 0 up to
        float32 rounding when this model computes what the cache did; a different dtype (a float32
        cache under bfloat16 training) or bfloat16's dependence on the batch's shape shows here."""
        slots = inputs.slots()
        slots = slots[: responses or self.score_batch_size]
        groups = [i for i, _ in slots] if self.share_prompts else None
        passed = anchor_pass(self.model, [inputs.sequences[i][j] for i, j in slots], self.pad_token_id,
                             input_grads=False, chunk_size=self.chunk_size, groups=groups)
        reference = torch.stack([inputs.ref_logp[i, j] for i, j in slots])  # [R]
        return float((passed.logp.cpu() - reference).abs().max())

    def fit(self, inputs: PolicyInputs, rankings: Rankings, weights: torch.Tensor, iteration: int = 0) -> None:
        """Weighted M-step: minimise - sum_ic w_ic log P_c(sigma_i) over ``epochs`` passes
        (``first_epochs`` at iteration 0)."""
        pairs = torch.nonzero(weights > 0)  # [P, 2] (example, cluster)
        if pairs.shape[0] == 0:
            return
        picks = self._anchor_picks(inputs, iteration, self.anchors)
        on_device = _MStepTerms.of(inputs, picks, self._estimates(inputs, iteration, picks), weights, self.model.device)
        largest = max(len(picks[i]) for i in pairs[:, 0].tolist())  # rows of the largest (example, cluster) pair
        objectives: list[torch.Tensor] = []  # per optimizer step, on the device
        every = 1 if self.model.device.type == "cpu" else PROGRESS_EVERY  # steps between two reads, for the bar
        self.lora.train_dropout(True)
        epochs = self.first_epochs if iteration == 0 else self.epochs
        bar = self._bar(total=epochs * -(-pairs.shape[0] // self.batch_size), desc=f"M-step {iteration}")
        try:
            with self._dropout_masks(iteration), passes_sized_by(
                    f"the M-step runs whole (example, cluster) pairs, up to score_batch_size = {self.score_batch_size} "
                    f"rows a pass but never fewer than a pair's {largest}; lower train.score_batch_size, or with "
                    "every response exact (a pair is all its m' responses) use anchors (train.anchors) or shorter "
                    f"responses (cache.max_response_tokens){self._or_checkpointing()}"):
                for _ in range(epochs):
                    order = pairs[torch.randperm(pairs.shape[0], generator=self._shuffle)]
                    for start in range(0, order.shape[0], self.batch_size):
                        batch = order[start : start + self.batch_size]  # [B, 2]
                        self.optimizer.zero_grad()
                        objective = 0.0
                        for group in self._row_groups(batch.tolist(), on_device.picks):
                            objective += self._weighted_logp(inputs, rankings, on_device, group, batch.shape[0])
                        self.optimizer.step(batch[:, 1].tolist())  # the clusters: the adapters it routed
                        objectives.append(objective)
                        bar.update()
                        if len(objectives) % every == 0:  # on a GPU, one wait for it per so many steps
                            recent = torch.stack(objectives[-max(every, 20):]).tolist()
                            bar.set_postfix(weighted_logP=f"{np.mean(recent):.4f}", refresh=False)
        finally:
            bar.close()
            self.lora.train_dropout(False)
            self.optimizer.zero_grad()  # the last step's gradients, k adapters' worth, freed
        losses = torch.stack(objectives).tolist()
        self.last_fit = {"iteration": iteration, "pairs": int(pairs.shape[0]), "steps": len(losses),
                         "weighted_log_likelihood_last_epoch": float(np.mean(losses[-(len(losses) // epochs):]))}

    @contextmanager
    def _dropout_masks(self, iteration: int) -> Iterator[None]:
        """The global RNG (LoRA dropout's) seeded by (seed, iteration) for one M-step and restored after,
        so a redone M-step (EM's backtracking) and a resumed run draw the masks an uninterrupted run drew."""
        seed = seed_from(f"dropout {self.seed} {iteration}")
        cuda = [self.model.device.index or 0] if self.model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # restores the CPU's and the model's GPU's generators only
            torch.random.default_generator.manual_seed(seed)
            for index in cuda:
                torch.cuda.default_generators[index].manual_seed(seed)
            yield

    def scale_steps(self, factor: float) -> None:
        """The M-step's learning rate becomes ``factor`` * lr (EM's backtracking)."""
        self.optimizer.lr = factor * self.lr

    def ranking_features(self, inputs: PolicyInputs, rankings: Rankings, width: int = 32, dim: int = 256) -> torch.Tensor:
        """Fisher-score features for the k-means start: float64 [n, dim].

        sum_j (d log P / d r_j at r = 0) * h(y_j), with h(y_j) the input embeddings of the first
        ``width`` response tokens flattened (position matters: which token sits where is what the
        rankings disagree on), then a seeded Gaussian projection to ``dim`` dimensions.
        """
        from moplex_core.pl import score_gradient_at_zero

        slot_weights = score_gradient_at_zero(rankings.index, rankings.model)  # [n, M]
        d = self.model.get_input_embeddings().weight.shape[1]
        generator = torch.Generator().manual_seed(self.seed)
        projection = torch.randn(width * d, dim, generator=generator, dtype=torch.float64) / dim**0.5
        features = torch.zeros(len(inputs), dim, dtype=torch.float64)
        for i, seqs in enumerate(inputs.sequences):
            emb = response_embeddings(self.model, seqs)[0].cpu()  # [m', T, d]
            emb = torch.nn.functional.pad(emb[:, :width], (0, 0, 0, max(0, width - emb.shape[1])))
            pooled = (slot_weights[i, : len(seqs), None, None] * emb.double()).sum(0)  # [width, d]
            features[i] = pooled.flatten() @ projection
        return features

    def response_features(self, inputs: PolicyInputs, width: int = 16) -> torch.Tensor:
        """Features in which every cluster's score is linear at the start, for the `linearized`
        initialisation (moplex_core.em): float64 [n, M, width**2], zeros at padding slots.

        For each response, the gradient of log pi_ref(y|x) w.r.t. the output layer's weight, projected
        by seeded Gaussian matrices to width x width (`output_score_features`): r_c(y) moves by
        <Theta_c, feature(y)> to first order when adapter c changes the output layer by a rank-limited
        step. One forward of the base model per response, ``score_batch_size`` rows at a time.
        """
        generator = torch.Generator().manual_seed(self.seed)
        vocab, hidden = self.model.get_output_embeddings().weight.shape
        device = next(self.model.parameters()).device
        # drawn on the CPU (the same features on any device), moved once: [V, width] is 19 MB for Qwen3
        left = torch.randn(vocab, width, generator=generator, dtype=torch.float64).to(device)  # [V, width]
        right = torch.randn(hidden, width, generator=generator, dtype=torch.float64).to(device)  # [d, width]
        slots = inputs.slots()
        features = torch.zeros(len(inputs), inputs.tiers.shape[1], width * width, dtype=torch.float64)
        for start in self._bar(range(0, len(slots), self.score_batch_size), desc="response features", unit="batch"):
            chunk = slots[start : start + self.score_batch_size]
            batch = pad_batch([inputs.sequences[i][j] for i, j in chunk], self.pad_token_id)
            rows = output_score_features(self.model, to_device(batch.input_ids, device), batch.attention_mask,
                                         batch.response_mask, left, right, chunk_size=self.chunk_size)
            for (i, j), row in zip(chunk, rows, strict=True):
                features[i, j] = row
        return features

    def state_dict(self) -> dict[str, Any]:
        """A snapshot on the CPU (copies, not views) of everything a resumed run needs."""
        estep = None if self._estep is None else {"round": self._estep.round, "inputs": self._estep.inputs,
                                                   "deltas": self._estep.deltas.clone()}
        return {
            "adapters": {name: p.detach().cpu().clone() for name, p in self._lora.items()},
            "optimizer": self.optimizer.state_dict(),
            "shuffle_rng": self._shuffle.get_state(),
            "estep": estep,
            "fell_back": None if self.fell_back is None else dict(self.fell_back),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self._lora) ^ set(state["adapters"])
        if missing:
            raise ValueError(f"the saved state's LoRA parameters differ from this scorer's ({len(missing)} "
                             "names); was it saved with another k, rank, target_modules or moplex version?")
        with torch.no_grad():
            for name, p in self._lora.items():
                p.copy_(state["adapters"][name])
        self.optimizer.load_state_dict(state["optimizer"])  # copies: a state restored twice shares nothing
        self._shuffle.set_state(state["shuffle_rng"])
        estep = state.get("estep")  # a state saved before 2026-11-25 kept offsets: recomputed when needed
        self._estep = None if estep is None or "deltas" not in estep else _EStepEstimates(
            estep["round"], estep["inputs"], estep["deltas"].clone())
        fell_back = state.get("fell_back")  # absent from states saved before the exact fallback existed
        self.fell_back = None if fell_back is None else dict(fell_back)

    # -- adapters in PEFT's format -------------------------------------------------------------

    def save_adapters(self, directory: str | Path) -> Path:
        """Write ``directory/cN/`` (adapter_config.json + adapter_model.safetensors) for every
        cluster: each loads with ``PeftModel.from_pretrained(base, directory / "cN")``."""
        return self.lora.save_peft(directory, self.adapter_names, self.model.name_or_path)

    def load_adapters(self, directory: str | Path) -> None:
        """Load ``directory/cN/`` written by `save_adapters` (or by PEFT) into the k adapters."""
        for c, name in enumerate(self.adapter_names):
            path = Path(directory) / name
            if not path.is_dir():
                raise FileNotFoundError(f"{path} does not exist; expected one PEFT adapter folder per cluster "
                                        f"c0..c{self.k - 1} as save_adapters writes")
            self.lora.load_peft(c, path)

    # -- internals -----------------------------------------------------------------------------

    def _bar(self, iterable: Any = None, **kwargs: Any) -> tqdm:
        """A progress bar of one M-step, E-step or scoring pass, gone when done. On a terminal it
        nests under the train stage's EM bar, if one is open; elsewhere (a log file, a pipe: chaos/
        reads these bars) it takes the first line, since a nested bar moves the cursor up with escape
        codes, which a file keeps as they are."""
        position = None if self.progress and getattr(sys.stderr, "isatty", lambda: False)() else 0
        return tqdm(iterable, disable=not self.progress, leave=False, position=position, **kwargs)

    def _anchor_picks(self, inputs: PolicyInputs, round_: int, anchors: int | None) -> list[torch.Tensor]:
        """The anchors of round ``round_`` of every example: int64 [a_i] each (all responses when full)."""
        def lengths(seqs: Sequence[TokenizedResponse]) -> list[int] | None:
            return [len(s.input_ids) - s.response_start for s in seqs] if self.anchor_draw == "by_length" else None

        picks = [torch.as_tensor(anchor_indices(eid, len(seqs), anchors, self.seed, round_, lengths(seqs)))
                 for eid, seqs in zip(inputs.example_ids, inputs.sequences, strict=True)]
        if inputs.ref_contraction is None and _estimated_examples(inputs, picks):
            raise ValueError(f"a = {anchors} anchors estimate scores from the reference contractions s_ref, and these "
                             "inputs have none (cache.contractions = false): score every response exactly "
                             "(anchors = None)")  # the stages refuse it first (config.no_contractions_message)
        return picks

    def _row_groups(self, pairs: list[list[int]], picks: list[torch.Tensor]) -> Iterator[list[list[int]]]:
        """Consecutive runs of (example, cluster) pairs of at most ``score_batch_size`` rows (a pair's
        rows never split: its likelihood needs all its anchors; a pair larger than that is alone)."""
        group: list[list[int]] = []
        rows = 0
        for pair in pairs:
            size = len(picks[pair[0]])
            if group and rows + size > self.score_batch_size:
                yield group
                group, rows = [], 0
            group.append(pair)
            rows += size
        if group:
            yield group

    def _weighted_logp(self, inputs: PolicyInputs, rankings: Rankings, terms: _MStepTerms, pairs: list[list[int]],
                       batch_pairs: int) -> torch.Tensor:
        """One forward + backward over the anchors of ``pairs``: accumulates the gradient of
        -sum w_ic log P_c(sigma_i) / batch_pairs into the adapters; returns the weighted log-likelihood,
        a float64 scalar on the model's device. Nothing here waits for the device: the Plackett-Luce
        likelihood runs there, on the ``terms`` copied there once per M-step."""
        rows = [(i, c, j) for i, c in pairs for j in terms.picks[i].tolist()]
        logp = self._pass(inputs, rows, input_grads=False, train=True)[0]  # [R] on the device, the graph kept
        width = rankings.tiers.shape[1]
        deltas = [torch.nn.functional.pad(hold_estimates(idx, anchor_delta, terms.estimates[i, c, : terms.sizes[i]]),
                                          (0, width - terms.sizes[i]))
                  for (i, c), idx, anchor_delta in _anchor_deltas(terms.ref_logp, pairs, terms.picks_there, logp)]
        on_host = torch.tensor(pairs)  # [P, 2] (example, cluster)
        index = rankings.subset(on_host[:, 0]).index  # sorted on the host, copied over
        there = RankingIndex(*(to_device(t, logp.device) for t in (index.order, index.in_slate, index.observed,
                                                                       index.last)))
        logp_rank = LIKELIHOODS[rankings.model](self.beta * torch.stack(deltas), there)  # [P]
        at = to_device(on_host, logp.device)  # one copy
        weight = terms.weights[at[:, 0], at[:, 1]]  # [P]
        objective = (weight * logp_rank).sum() / batch_pairs
        (-objective).backward()
        return objective.detach()

    def _or_checkpointing(self) -> str:
        """The end of an out-of-memory message of a pass with gradients: the other way to fit it."""
        return "" if self.gradient_checkpointing else "; or set train.gradient_checkpointing = true"

    def _score_all(self, inputs: PolicyInputs, round_: int, anchors: int | None, what: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The deltas float64 [n, k, M] with the anchors of round ``round_`` (the scores over beta:
        exact at the anchors, estimated elsewhere) and the anchor mask bool [n, M]."""
        n, m = inputs.tiers.shape
        picks = self._anchor_picks(inputs, round_, anchors)
        # The examples with a response to estimate first: their rows take input gradients. The others
        # (every response an anchor, in a ragged slate) run forward only, in passes of their own.
        estimated = _estimated_examples(inputs, picks)
        pairs = [(i, c) for i in estimated + sorted(set(range(n)) - set(estimated)) for c in range(self.k)]
        rows = [(i, c, j) for i, c in pairs for j in picks[i].tolist()]  # a pair's anchors in a run, as in the M-step
        with_grads = self.k * sum(len(picks[i]) for i in estimated)  # rows[:with_grads] take input gradients
        copies = HostCopies()  # per pass: float64 [rows] and [rows, M] (None without input gradients)
        copies.add(  # an empty first entry, so that no rows (an empty split) give empty results
            (torch.zeros(0, dtype=torch.float64), torch.zeros(0, m, dtype=torch.float64)))
        bar = self._bar(total=len(rows), desc=what, unit="row")
        half = max(1, self.score_batch_size // 2)
        try:
            for part, input_grads in ((rows[:with_grads], True), (rows[with_grads:], False)):
                with passes_sized_by(f"{what} runs up to score_batch_size = {self.score_batch_size} rows a pass (a "
                                     f"response under one adapter{', with its input gradients' if input_grads else ''});"
                                     f" lower it (--set train.score_batch_size={half}, or evaluate.score_batch_size in "
                                     f"evaluate){self._or_checkpointing() if input_grads else ''}"):
                    for start in range(0, len(part), self.score_batch_size):
                        chunk = part[start : start + self.score_batch_size]
                        copies.add(self._pass(inputs, chunk, input_grads=input_grads, train=False))
                        bar.update(len(chunk))
        finally:
            bar.close()
        passes = copies.results()
        logp = torch.cat([part for part, _ in passes])  # [R]
        s_policy = torch.cat([part for _, part in passes if part is not None])  # [rows with input gradients, M]
        is_anchor = torch.zeros(n, m, dtype=torch.bool)
        for i, idx in enumerate(picks):
            is_anchor[i, idx] = True
        weights = self._anchor_weights(inputs, picks, estimated)  # example -> float64 [a_i, m'_i] or None
        offsets = torch.zeros(n, self.k, m, dtype=torch.float64)
        offset = 0
        for i, c in pairs[: self.k * len(estimated)]:  # s_policy's rows, in order
            size, idx = len(inputs.sequences[i]), picks[i]
            offsets[i, c, :size] = estimate_offsets(
                self.estimation, idx, s_policy[offset : offset + len(idx), :size], inputs.ref_logp[i, :size],
                inputs.ref_contraction[i, :size, :size], weights[i])
            offset += len(idx)
        deltas = torch.zeros(n, self.k, m, dtype=torch.float64)
        for (i, c), idx, anchor_delta in _anchor_deltas(inputs.ref_logp, pairs, picks, logp):
            size = len(inputs.sequences[i])
            deltas[i, c, :size] = apply_offsets(idx, anchor_delta, offsets[i, c, :size], weights.get(i))
        return deltas, is_anchor

    def _anchor_weights(self, inputs: PolicyInputs, picks: list[torch.Tensor], examples: Sequence[int]
                        ) -> dict[int, torch.Tensor | None]:
        """Each of ``examples``' weights of its anchors' estimates (`estimate_offsets`): float64 [a_i, m'_i]
        on the CPU for ``nearest``, None for the mean."""
        if self.anchor_weighting == "mean" or not examples:
            return dict.fromkeys(examples)
        there = [nearest_anchor_weights(to_device(picks[i], self.model.device),
                                        response_embeddings(self.model, inputs.sequences[i])[0]) for i in examples]
        moved = torch.cat([w.flatten() for w in there]).cpu().split([w.numel() for w in there])  # one wait
        return {i: w.view(there_w.shape) for i, w, there_w in zip(examples, moved, there, strict=True)}

    def _estimates(self, inputs: PolicyInputs, round_: int, picks: list[torch.Tensor]) -> torch.Tensor:
        """The deltas float64 [n, k, M] that round ``round_``'s anchors estimate at the current
        parameters, which an M-step holds: the last E-step's when it ran on these inputs with these
        anchors; from the cache when every adapter is still the base model (s_c = s_ref, and the
        anchors' delta_c 0, up to the cache's reference gap); else an input-gradient pass now."""
        n, m = inputs.tiers.shape
        estimated = _estimated_examples(inputs, picks)
        if not estimated:
            return torch.zeros(n, self.k, m, dtype=torch.float64)
        if self._estep is not None and self._estep.round == round_ and self._estep.inputs == _inputs_key(inputs):
            return self._estep.deltas
        if self.lora.at_base():
            deltas = torch.zeros(n, self.k, m, dtype=torch.float64)
            weights = self._anchor_weights(inputs, picks, estimated)
            for i in estimated:
                size, idx = len(inputs.sequences[i]), picks[i]
                s_ref = inputs.ref_contraction[i, :size, :size]
                deltas[i, :, :size] = estimate_offsets(self.estimation, idx, s_ref[idx], inputs.ref_logp[i, :size],
                                                       s_ref, weights[i])
            return deltas
        log.info("M-step %d: no E-step of these inputs at these anchors; computing their input gradients first",
                 round_)
        return self._score_all(inputs, round_, self.anchors, f"input gradients {round_}")[0]

    def _pass(self, inputs: PolicyInputs, rows: Sequence[Row], *, input_grads: bool, train: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One `anchor_pass` over ``rows``, each under its cluster's adapter, on the model's device:
        log pi_c(y_j|x_i) float64 [R] (with the graph into the adapters when ``train``) and, with
        ``input_grads``, each row's contraction s_c[j][:] with its example's responses (float64 [R, M],
        zero past the example's m'_i responses)."""
        seqs: list[TokenizedResponse] = [inputs.sequences[i][j] for i, _, j in rows]
        groups = [(i, c) for i, c, _ in rows] if self.share_prompts else None
        with self.lora.requires_grad(train):
            passed = anchor_pass(self.model, seqs, self.pad_token_id, input_grads=input_grads, keep_graph=train,
                                 chunk_size=self.chunk_size, groups=groups,
                                 route=lambda sub: self.lora.route([rows[r][1] for r in sub]),
                                 alternatives=[inputs.sequences[i] for i, _, _ in rows] if input_grads else None)
        if not input_grads:
            return passed.logp, None
        width = inputs.tiers.shape[1]
        contractions: list[torch.Tensor] = []  # [rows of one example, M] each
        start = 0
        while start < len(rows):  # consecutive rows of one example share its response embeddings
            i = rows[start][0]
            end = start
            while end < len(rows) and rows[end][0] == i:
                end += 1
            emb, lengths = response_embeddings(self.model, inputs.sequences[i])  # [m', T, d], [m']
            idx = to_device(torch.tensor([j for _, _, j in rows[start:end]]), emb.device)
            s = passed.first_order(slice(start, end), idx, emb, lengths)  # [rows, m'_i]
            contractions.append(torch.nn.functional.pad(s, (0, width - s.shape[1])))
            start = end
        return passed.logp, torch.cat(contractions)


def _anchor_deltas(ref_logp: torch.Tensor, pairs: Sequence[Sequence[int]], picks: Sequence[torch.Tensor],
                   logp: torch.Tensor) -> Iterator[tuple[tuple[int, int], torch.Tensor, torch.Tensor]]:
    """((example i, cluster c), the anchors int64 [a_i], their exact delta_c(y_j|x_i) = log pi_c -
    log pi_ref float64 [a_i], with logp's graph) of each pair. Every tensor on one device.

    ref_logp: the cache's log pi_ref, float64 [n, M]; picks: the anchors of each example, int64 [a_i].
    logp: log pi_c of the anchors, float64 [R], one row per anchor, pair after pair in ``pairs``' order.
    """
    start = 0
    for i, c in pairs:
        idx = picks[i]
        yield (i, c), idx, logp[start : start + len(idx)] - ref_logp[i, idx]  # [a]
        start += len(idx)


PROGRESS_EVERY = 16
"""M-step optimizer steps between two updates of the progress bar's weighted log-likelihood on a GPU,
each a wait for it (the steps themselves never wait: their objectives stay there); every step on the
CPU, where reading costs nothing."""


@dataclass(frozen=True)
class _MStepTerms:
    """What an M-step's Plackett-Luce objective reads besides the passes' log-probs, on the model's
    device (copied once per M-step), and the anchors on the host as the passes' rows are listed."""

    picks: list[torch.Tensor]  # int64 [a_i] per example, on the host
    picks_there: list[torch.Tensor]  # the same on the device
    sizes: list[int]  # m'_i per example
    ref_logp: torch.Tensor  # float64 [n, M]
    estimates: torch.Tensor  # float64 [n, k, M]: the deltas the M-step holds (`LoRAPolicyScorer._estimates`)
    weights: torch.Tensor  # float64 [n, k]

    @classmethod
    def of(cls, inputs: PolicyInputs, picks: list[torch.Tensor], estimates: torch.Tensor, weights: torch.Tensor,
           device: torch.device) -> _MStepTerms:
        there = to_device(torch.cat(picks), device).split([len(p) for p in picks])  # one copy
        return cls(picks, list(there), [len(seqs) for seqs in inputs.sequences], to_device(inputs.ref_logp, device),
                   to_device(estimates, device), to_device(weights, device))


def _estimated_examples(inputs: PolicyInputs, picks: list[torch.Tensor]) -> list[int]:
    """The examples with a response that is not an anchor, whose scores are estimated; none under full
    computation (so no input gradients, offsets or estimates)."""
    return [i for i, (p, seqs) in enumerate(zip(picks, inputs.sequences, strict=True)) if len(p) < len(seqs)]


def _inputs_key(inputs: PolicyInputs) -> str:
    return hashlib.sha256(json.dumps(inputs.example_ids).encode()).hexdigest()


class ExactView:
    """A LoRAPolicyScorer whose `score` is always exact (DESIGN 5.4: evaluation uses exact scores)."""

    def __init__(self, scorer: LoRAPolicyScorer) -> None:
        self.scorer = scorer
        self.k = scorer.k

    def score(self, inputs: PolicyInputs, iteration: int = 0) -> torch.Tensor:
        return self.scorer.exact_scores(inputs)
