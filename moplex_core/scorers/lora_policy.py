"""k LoRA adapters on one base language model as the k clusters' scorers (DESIGN 5.1, 5.3-5.5).

    r_c(x, y) = beta * (log pi_c(y|x) - log pi_ref(y|x)),   pi_c = base + adapter "c<c>",
                                                              pi_ref = base, adapters disabled

log pi_ref of every response and the reference contraction s_ref come from the `cache` artifact
(`PolicyInputs`), so pi_ref is never run here. With ``anchors = a < m'`` the scores of non-anchor
responses are estimated from a anchors per example (moplex_core.estimate, paper Algorithm 1); the
anchors of EM iteration t are the same in its M-step (`fit`) and E-step (`score`).

M-step: minibatches of (example, cluster) pairs with nonzero weight, shuffled by a seeded generator
whose state is part of `state_dict`; the rows of one minibatch are grouped by cluster and each group
runs under its adapter; one AdamW optimizer holds every adapter's parameters. (PEFT's
``set_adapter`` switches requires_grad off on the other adapters; `_activate` switches it back, so
the optimizer never silently loses an adapter.) Per minibatch and cluster group: one forward with
the anchors' input embeddings requiring grad, grad_h for the estimated scores (constants), then the
backward of the weighted loss into the LoRA parameters through the anchors' exact scores only.

E-step: per cluster, one forward + input-gradient pass over the anchors with every LoRA parameter
frozen (full computation: a forward only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, load_peft_weights, set_peft_model_state_dict
from tqdm.auto import tqdm

from moplex_core.em import Rankings
from moplex_core.estimate import (
    ESTIMATION_MODES,
    EstimationMode,
    anchor_indices,
    anchor_pass,
    contraction,
    estimate_delta,
    response_embeddings,
)
from moplex_core.lm.loading import load_model
from moplex_core.lm.tokenize import TokenizedResponse
from moplex_core.pl import PAD

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyInputs:
    """n examples as the `cache` artifact holds them, plus their tiers (M = max m' over examples).

    sequences[i][j] is prompt + response j of example i (originals first, then generated ones).
    Slots j >= m'_i are padding: tier PAD, ref_logp 0, ref_contraction 0.
    """

    example_ids: tuple[str, ...]
    sequences: tuple[tuple[TokenizedResponse, ...], ...]
    ref_logp: torch.Tensor  # float64 [n, M]: log pi_ref(y_j|x), response tokens incl. EOS
    ref_contraction: torch.Tensor  # float32 [n, M, M]: s_ref[i][j]
    tiers: torch.Tensor  # int64 [n, M], codes of moplex_core.pl
    ranked_prefix: torch.Tensor | None = None  # int64 [n]

    def __post_init__(self) -> None:
        n, m = self.tiers.shape
        if not (len(self.example_ids) == len(self.sequences) == n and self.ref_logp.shape == (n, m)
                and self.ref_contraction.shape == (n, m, m)):
            raise ValueError(
                f"PolicyInputs parts disagree: {len(self.example_ids)} ids, {len(self.sequences)} "
                f"sequence lists, ref_logp {tuple(self.ref_logp.shape)}, ref_contraction "
                f"{tuple(self.ref_contraction.shape)}, tiers {tuple(self.tiers.shape)}"
            )
        sizes = [len(s) for s in self.sequences]
        if sizes != (self.tiers != PAD).sum(1).tolist():
            raise ValueError("every example needs exactly one non-PAD tier per response; the cache and "
                             "the rankings it was built from disagree (rebuild the cache)")

    def __len__(self) -> int:
        return len(self.example_ids)

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
            self.ref_contraction[idx, :width, :width],
            self.tiers[idx, :width],
            None if self.ranked_prefix is None else self.ranked_prefix[idx],
        )


@dataclass(frozen=True)
class LoRASettings:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ScoreRecord:
    """What one `score` call computed, for scores.parquet."""

    iteration: int
    example_ids: tuple[str, ...]
    scores: torch.Tensor  # float64 [n, k, M]
    is_anchor: torch.Tensor  # bool [n, M] (the same anchors for every cluster)
    in_slate: torch.Tensor  # bool [n, M]


class LoRAPolicyScorer:
    """The Scorer of moplex_core.em for a language model with k LoRA adapters.

    model_path:        base model directory (or a cached hub name); pi_ref.
    k, beta:           clusters; r = beta * log-ratio.
    anchors:           a per example, None = every response exact (the full-computation ablation).
    estimation:        "delta" or "logpi" (moplex_core.estimate).
    lr, epochs:        AdamW learning rate; passes over the weighted pairs per M-step.
    batch_size:        (example, cluster) pairs per M-step minibatch.
    score_batch_size:  examples per E-step batch (times a anchor rows per forward).
    seed:              adapter initialisation (LoRA A), M-step shuffling and anchor draws.
    """

    def __init__(
        self,
        model_path: str | Path,
        k: int,
        *,
        beta: float = 0.1,
        anchors: int | None = None,
        estimation: EstimationMode = "delta",
        lora: LoRASettings = LoRASettings(),
        lr: float = 1e-4,
        epochs: int = 1,
        batch_size: int = 16,
        score_batch_size: int = 16,
        chunk_size: int = 1024,
        seed: int = 0,
        dtype: str | torch.dtype = torch.float32,
        device: str = "cpu",
        progress: bool = False,
    ) -> None:
        if estimation not in ESTIMATION_MODES:
            raise ValueError(f"estimation must be one of {ESTIMATION_MODES}, got {estimation!r}")
        if k < 1 or beta <= 0 or epochs < 1 or batch_size < 1 or score_batch_size < 1:
            raise ValueError(f"need k >= 1, beta > 0, epochs, batch sizes >= 1; got k={k}, beta={beta}, "
                             f"epochs={epochs}, batch_size={batch_size}, score_batch_size={score_batch_size}")
        self.k, self.beta, self.anchors, self.estimation = k, beta, anchors, estimation
        self.epochs, self.batch_size, self.score_batch_size = epochs, batch_size, score_batch_size
        self.chunk_size, self.seed, self.progress = chunk_size, seed, progress
        self.adapter_names = [f"c{c}" for c in range(k)]
        base = load_model(model_path, dtype=dtype, device=device)
        self.pad_token_id = base.config.pad_token_id if base.config.pad_token_id is not None else 0
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none")
        with torch.random.fork_rng(devices=[]):
            # PEFT draws LoRA A from the global RNG; seed it here without touching the caller's.
            torch.manual_seed(seed)
            self.model: PeftModel = get_peft_model(base, config, adapter_name=self.adapter_names[0])
            for name in self.adapter_names[1:]:
                self.model.add_adapter(name, config)
        self.model.eval()
        # Sorted names: the optimizer's parameter order (and so its state_dict) is reproducible.
        self._lora = dict(sorted((n, p) for n, p in self.model.named_parameters() if ".lora_" in n))
        if not self._lora:
            raise ValueError(f"no LoRA parameters were created: target_modules {lora.target_modules} match "
                             f"no module of {type(base).__name__}; name its linear layers, e.g. q_proj, v_proj")
        self._set_param_grads(True)
        self.optimizer = torch.optim.AdamW(list(self._lora.values()), lr=lr, weight_decay=0.0)
        self._shuffle = torch.Generator().manual_seed(seed)
        self.last_scores: ScoreRecord | None = None
        self.last_fit: dict[str, Any] = {}

    # -- the Scorer protocol -------------------------------------------------------------------

    def score(self, inputs: PolicyInputs, iteration: int = 0) -> torch.Tensor:
        """E-step scores float64 [n, k, M] (estimated for non-anchors when anchors < m')."""
        scores, is_anchor = self._score_all(inputs, iteration, self.anchors, "E-step")
        self.last_scores = ScoreRecord(iteration, inputs.example_ids, scores, is_anchor, inputs.tiers != PAD)
        return scores

    def exact_scores(self, inputs: PolicyInputs) -> torch.Tensor:
        """Every response exact, float64 [n, k, M] (evaluation, DESIGN 5.4)."""
        return self._score_all(inputs, 0, None, "exact scores")[0]

    def exact(self) -> ExactView:
        """This scorer seen through the Scorer protocol with exact scores (for evaluate_mixture)."""
        return ExactView(self)

    def fit(self, inputs: PolicyInputs, rankings: Rankings, weights: torch.Tensor, iteration: int = 0) -> None:
        """Weighted M-step: minimise - sum_ic w_ic log P_c(sigma_i) over ``epochs`` passes."""
        pairs = torch.nonzero(weights > 0)  # [P, 2] (example, cluster)
        if pairs.shape[0] == 0:
            return
        losses = []
        self.model.train()
        bar = tqdm(total=self.epochs * -(-pairs.shape[0] // self.batch_size), desc=f"M-step {iteration}",
                   disable=not self.progress, leave=False)
        try:
            for _ in range(self.epochs):
                order = pairs[torch.randperm(pairs.shape[0], generator=self._shuffle)]
                for start in range(0, order.shape[0], self.batch_size):
                    batch = order[start : start + self.batch_size]
                    self.optimizer.zero_grad(set_to_none=True)
                    weighted_logp = 0.0
                    for c in batch[:, 1].unique().tolist():
                        rows = batch[batch[:, 1] == c, 0]
                        sub = inputs.subset(rows)
                        scores, _ = self._cluster_scores(sub, c, iteration, self.anchors, train=True)
                        padded = torch.nn.functional.pad(scores, (0, rankings.tiers.shape[1] - scores.shape[1]))
                        logp = rankings.subset(rows).log_likelihood(padded)  # [B_c]
                        objective = (weights[rows, c] * logp).sum() / batch.shape[0]
                        (-objective).backward()
                        weighted_logp += objective.item()
                    self.optimizer.step()
                    losses.append(weighted_logp)
                    bar.update()
                    bar.set_postfix(weighted_logP=f"{np.mean(losses[-20:]):.4f}")
        finally:
            bar.close()
            self.model.eval()
        self.last_fit = {"iteration": iteration, "pairs": int(pairs.shape[0]), "steps": len(losses),
                         "weighted_log_likelihood_last_epoch": float(np.mean(losses[-(len(losses) // self.epochs):]))}

    def ranking_features(self, inputs: PolicyInputs, rankings: Rankings, width: int = 32, dim: int = 256) -> torch.Tensor:
        """Fisher-score features for the k-means start: float64 [n, dim].

        sum_j (d log P / d r_j at r = 0) * h(y_j), with h(y_j) the input embeddings of the first
        ``width`` response tokens flattened (position matters: which token sits where is what the
        rankings disagree on), then a seeded Gaussian projection to ``dim`` dimensions.
        """
        from moplex_core.pl import score_gradient_at_zero

        slot_weights = score_gradient_at_zero(rankings.index, rankings.model)  # [n, M]
        d = self.model.get_base_model().get_input_embeddings().weight.shape[1]
        generator = torch.Generator().manual_seed(self.seed)
        projection = torch.randn(width * d, dim, generator=generator, dtype=torch.float64) / dim**0.5
        features = torch.zeros(len(inputs), dim, dtype=torch.float64)
        for i, seqs in enumerate(inputs.sequences):
            emb, _ = response_embeddings(self.model, seqs)  # [m', T, d]
            emb = torch.nn.functional.pad(emb[:, :width], (0, 0, 0, max(0, width - emb.shape[1])))
            pooled = (slot_weights[i, : len(seqs), None, None] * emb.double()).sum(0)  # [width, d]
            features[i] = pooled.flatten() @ projection
        return features

    def state_dict(self) -> dict[str, Any]:
        return {
            "adapters": {name: p.detach().clone() for name, p in self._lora.items()},
            "optimizer": self.optimizer.state_dict(),
            "shuffle_rng": self._shuffle.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self._lora) ^ set(state["adapters"])
        if missing:
            raise ValueError(f"the saved state's LoRA parameters differ from this scorer's ({len(missing)} "
                             "names); was it saved with another k, rank or target_modules?")
        with torch.no_grad():
            for name, p in self._lora.items():
                p.copy_(state["adapters"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self._shuffle.set_state(state["shuffle_rng"])

    # -- adapters in PEFT's format -------------------------------------------------------------

    def save_adapters(self, directory: str | Path) -> Path:
        """Write ``directory/cN/`` (adapter_config.json + adapter_model.safetensors) for every
        cluster: each loads with ``PeftModel.from_pretrained(base, directory / "cN")``.

        ``target_modules`` is written sorted: PEFT keeps it as a set and writes the set's order,
        which follows the process's string hash seed, so equal adapters saved by two processes (a
        killed train run and its rerun) would get different bytes."""
        self.model.save_pretrained(str(directory), selected_adapters=self.adapter_names)
        for name in self.adapter_names:
            config_file = Path(directory) / name / "adapter_config.json"
            config = json.loads(config_file.read_text())
            config["target_modules"] = sorted(config["target_modules"])
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True))  # as PEFT writes it
        return Path(directory)

    def load_adapters(self, directory: str | Path) -> None:
        """Load ``directory/cN/`` written by `save_adapters` into the k adapters."""
        for name in self.adapter_names:
            path = Path(directory) / name
            if not (path / "adapter_config.json").is_file():
                raise FileNotFoundError(f"{path} holds no PEFT adapter (adapter_config.json); expected one "
                                        f"folder per cluster c0..c{self.k - 1} as save_adapters writes")
            set_peft_model_state_dict(self.model, load_peft_weights(str(path)), adapter_name=name)

    # -- internals -----------------------------------------------------------------------------

    def _score_all(self, inputs: PolicyInputs, iteration: int, anchors: int | None, what: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        n, m = inputs.tiers.shape
        scores = torch.zeros(n, self.k, m, dtype=torch.float64)
        is_anchor = torch.zeros(n, m, dtype=torch.bool)
        batches = [list(range(s, min(s + self.score_batch_size, n))) for s in range(0, n, self.score_batch_size)]
        bar = tqdm(total=len(batches) * self.k, desc=f"{what} {iteration}", disable=not self.progress, leave=False)
        best = []
        try:
            for rows in batches:
                sub = inputs.subset(rows)
                width = sub.tiers.shape[1]
                for c in range(self.k):
                    s, mask = self._cluster_scores(sub, c, iteration, anchors, train=False)
                    scores[rows, c, :width] = s
                    is_anchor[rows, :width] = mask
                    bar.update()
                logp = sub.rankings().log_likelihood(scores[rows, :, :width])  # [B, k]
                best.append(logp.max(1).values)
                bar.set_postfix(best_cluster_PL_logP=f"{torch.cat(best).mean().item():.4f}")
        finally:
            bar.close()
        return scores, is_anchor

    def _cluster_scores(self, inputs: PolicyInputs, c: int, iteration: int, anchors: int | None, *, train: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of cluster c for every example of ``inputs``: (float64 [n, M], anchor mask [n, M]).

        With ``train`` the anchors' scores carry the graph into adapter c's parameters.
        """
        n, m = inputs.tiers.shape
        picks = [torch.as_tensor(anchor_indices(eid, len(seqs), anchors, self.seed, iteration))
                 for eid, seqs in zip(inputs.example_ids, inputs.sequences, strict=True)]
        full = all(len(p) == len(seqs) for p, seqs in zip(picks, inputs.sequences, strict=True))
        rows = [inputs.sequences[i][j] for i, p in enumerate(picks) for j in p.tolist()]
        with self._activate(c, param_grads=train):
            passed = anchor_pass(self.model, rows, self.pad_token_id, input_grads=not full, keep_graph=train,
                                 chunk_size=self.chunk_size)
            deltas, masks = [], torch.zeros(n, m, dtype=torch.bool)
            offset = 0
            for i, p in enumerate(picks):
                size = len(inputs.sequences[i])
                logp = passed.logp[offset : offset + len(p)]  # [a]
                s_policy = None
                if len(p) < size:
                    emb, lengths = response_embeddings(self.model, inputs.sequences[i])
                    s_policy = contraction(passed.input_grads[offset : offset + len(p)], p, emb, lengths)
                delta = estimate_delta(self.estimation, p, logp, s_policy, inputs.ref_logp[i, :size],
                                       inputs.ref_contraction[i, :size, :size])
                deltas.append(torch.nn.functional.pad(delta, (0, m - size)))
                masks[i, p] = True
                offset += len(p)
        return self.beta * torch.stack(deltas), masks

    @contextmanager
    def _activate(self, c: int, *, param_grads: bool) -> Iterator[None]:
        """Adapter c active; LoRA parameters require grad only in the M-step (E-step gradients
        are w.r.t. the input embeddings alone)."""
        self.model.set_adapter(self.adapter_names[c])
        self._set_param_grads(param_grads)
        try:
            yield
        finally:
            self._set_param_grads(True)

    def _set_param_grads(self, flag: bool) -> None:
        for p in self._lora.values():
            p.requires_grad_(flag)


class ExactView:
    """A LoRAPolicyScorer whose `score` is always exact (DESIGN 5.4: evaluation uses exact scores)."""

    def __init__(self, scorer: LoRAPolicyScorer) -> None:
        self.scorer = scorer
        self.k = scorer.k

    def score(self, inputs: PolicyInputs, iteration: int = 0) -> torch.Tensor:
        return self.scorer.exact_scores(inputs)
