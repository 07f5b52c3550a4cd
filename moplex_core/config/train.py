"""The train stage's settings: EM over k LoRA adapters (DESIGN 5.3-5.5)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from moplex_core.config.base import Device, SharePrompts, StageConfig
from moplex_core.config.cache import ModelDtype


class TrainConfig(StageConfig):
    """The EM training stage: k LoRA adapters on the cache's base model (DESIGN 5.3-5.5).

    ``anchors`` = a responses per example computed exactly per EM iteration (the rest estimated,
    paper Algorithm 1); ``None`` computes every response (the `full` ablation). ``estimation``:
    ``delta`` linearises log pi_c - log pi_ref, ``logpi`` log pi_c alone (the authors' code).
    ``anchor_weighting``: a non-anchor's estimate is the ``mean`` of every anchor's first-order
    estimate of it (the paper's Algorithm 1) or the estimate of the ``nearest`` anchor in input
    embedding space alone, where the first-order term is most accurate (docs/lm-path.md, "Which anchor
    estimates a response"); in the version only with at least 2 anchors. ``anchor_draw``: the a
    anchors of an example are a ``uniform`` draw (the paper's) or ``by_length``, one from each of a
    strata of its responses sorted by length (`estimate.anchor_indices`): the first-order term stops
    at the shorter response, so a response estimated from a shorter anchor keeps none of its tail
    (docs/lm-path.md, "Anchors of every length"); in the version only with at least 2 anchors and
    when not ``uniform``.
    ``epochs`` passes over the weighted (example, cluster) pairs per M-step, in minibatches of
    ``batch_size`` pairs (a rows each, m' without anchors: the M-step's memory); ``first_epochs``
    (None = ``epochs``) for the first M-step, which starts with every adapter at the base model and
    must carry the start's partition into them. ``score_batch_size``
    is the rows (one response under one adapter, clusters mixed) per E-step or exact-scoring pass.
    ``share_prompts`` runs each (example, cluster)'s prompt once per pass for all its rows there
    (the same scores and gradients up to float rounding, for fewer tokens; with ``lora_dropout``
    the rows share the prompt's dropout mask): faster on the CPU (1.4-1.6x), slower on an H200, where
    the prompt pass is a second decoder call whose launches the host cannot issue fast enough (per
    EM iteration at m' = 26, a = 6: 3.25 s per example with the prompt per row, 5.51 shared; full
    computation 6.20 and 8.75; shared slower in every configuration where both ran,
    docs/gpu-efficiency.md). ``auto`` (the default) shares them on the CPU and not elsewhere
    (`moplex_core.config.prompts_shared`), and is versioned as what it resolves to. Trains on the
    cache's ``train`` split.

    ``likelihood`` is the observation model of a ranking: ``pl`` (Plackett-Luce, eq. 2 and 5) or
    ``bt_pairs`` (Bradley-Terry over every ordered pair of the ranking, as DPO and the mixture-of-BT
    baselines see it). ``hard`` replaces the posteriors by their one-hot argmax, and ``mixing =
    "uniform"`` holds the mixing weights at 1/k (with ``hard``, MaxMin-RLHF's assignment: each ranking
    to the cluster whose model gives it the highest likelihood; `moplex_core.em.EMConfig.mixing`). Both exist so that the baselines are presets of this one engine (DESIGN 7).

    ``init`` breaks the symmetry of the first M-step (moplex_core.em): ``linearized`` (default), the
    posteriors of a linear PL mixture over each response's output-layer score gradient under the
    base model (one extra forward per training response; `LoRAPolicyScorer.response_features`);
    ``kmeans`` over the rankings' Fisher-score features; a seeded ``dirichlet``; or ``labels``, the
    training rankings' own ``cluster`` labels (0.9 on the label's cluster, labels in sorted order to
    c0, c1, ...): a warm start from known groups (annotators, criteria, personas) that EM then
    refines, and the test of how much of a known partition the adapters can hold. It needs a label on
    every training ranking, exactly k labels, and one restart (every restart would start alike).

    ``backtracks``: when the training log-likelihood falls after an M-step, redo that M-step from
    where it started at half the learning rate, up to this many times per iteration (each costs one
    M-step and one E-step more; soft EM only). Soft EM never lowers the log-likelihood when every
    M-step raises its own objective; a few Adam steps may not. With anchors the log-likelihood before
    the M-step is taken again under this iteration's anchors, to compare like with like: one E-step
    more per iteration.

    ``estimation_check``: after every E-step, its estimated scores of this many training examples (a
    seeded draw, the same each iteration; 0 = none) are compared with their exact scores under the
    same adapters (`train.measure_estimates`, in each iteration's estimation.json; the last one and
    the trajectory in result.json, warned about outside `train.ESTIMATES_HOLD`). With anchors only.
    It is part of the version because result.json holds its outcome.

    ``exact_fallback``: when an E-step's estimates of those examples are off by more than this many
    times the spread of their exact scores (their relative error; `ESTIMATES_HOLD` warns above 1.0,
    where they say nothing about an order; 0.5 is a stricter guard), redo that iteration's M-step
    (whose estimated objective led there) and E-step with every response exact, and every later step
    too (the `full` computation from there; where, in result.json's ``fell_back``). Never train on
    estimates seen not to hold, at the price of exact passes once they fail (and, once, of the
    discarded M-step and E-step). None: never. Needs anchors and estimation_check > 0.

    ``gradient_checkpointing`` checkpoints every decoder layer (moplex_core.lm.checkpointing): the
    E-step's and the M-step's passes keep each layer's input instead of its activations and run its
    forward again in their backward, so a pass of score_batch_size rows needs about one layer's
    activations, for one forward more per pass and about twice its host time (peak and time with and
    without: benchmarks/activation_memory.py, benchmarks/host_ops.py). The same scores and gradients,
    bit for bit on the CPU: for a model or rows too large for the card otherwise, not for speed.

    Left out of the version: ``score_batch_size``, ``device``, ``chunk_size``, ``gradient_checkpointing``
    (how fast, not what),
    except that with LoRA dropout ``score_batch_size`` and the device type are in (`identity`).
    The base model is the one the cache was built from (its version pins the model's content).
    """

    k: int = Field(3, ge=1)
    beta: float = Field(0.1, gt=0.0)
    anchors: int | None = Field(2, ge=1)
    estimation: Literal["delta", "logpi"] = "delta"
    anchor_weighting: Literal["mean", "nearest"] = "mean"
    anchor_draw: Literal["uniform", "by_length"] = "uniform"
    likelihood: Literal["pl", "bt_pairs"] = "pl"
    hard: bool = False
    mixing: Literal["learned", "uniform"] = "learned"
    lora_r: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0.0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lr: float = Field(1e-4, gt=0.0)
    epochs: int = Field(1, ge=1)
    first_epochs: int | None = Field(None, ge=1)
    batch_size: int = Field(16, ge=1)
    gamma_min: float = Field(1e-3, ge=0.0, lt=1.0)
    em_iterations: int = Field(10, ge=1)
    tol: float = Field(1e-6, ge=0.0)
    init: Literal["linearized", "kmeans", "dirichlet", "labels"] = "linearized"
    restarts: int = Field(1, ge=1)
    backtracks: int = Field(0, ge=0)
    estimation_check: int = Field(64, ge=0)
    exact_fallback: float | None = Field(None, gt=0.0)
    seed: int = Field(0, ge=0)
    dtype: ModelDtype = "auto"
    """As the cache's: versioned as the dtype it resolves to on the machine that trains."""
    device: Device = "auto"
    score_batch_size: int = Field(32, ge=1)
    chunk_size: int = Field(1024, ge=1)
    share_prompts: SharePrompts = "auto"
    gradient_checkpointing: bool = False

    @field_validator("lora_targets")
    @classmethod
    def _some_targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or any(not t.strip() for t in v):
            raise ValueError(f"lora_targets must name at least one module (e.g. q_proj), got {v}")
        return v

    @model_validator(mode="after")
    def _backtracks_are_soft_em(self) -> TrainConfig:
        if self.hard and self.backtracks > 0:
            raise ValueError(f"train.backtracks = {self.backtracks} redoes M-steps after which the log-likelihood "
                             "fell, but hard EM (train.hard) may lower it legitimately and never backtracks: set "
                             "train.backtracks = 0")
        return self

    @model_validator(mode="after")
    def _fallback_has_a_check(self) -> TrainConfig:
        if self.exact_fallback is not None and (self.anchors is None or self.estimation_check == 0):
            raise ValueError("train.exact_fallback computes every response exactly once the anchors' estimates "
                             "fail the estimation check: it needs train.anchors (not null) and "
                             "train.estimation_check > 0")
        return self

    @model_validator(mode="after")
    def _restarts_can_differ(self) -> TrainConfig:
        if self.k == 1 and self.restarts > 1:
            raise ValueError(f"train.k = 1 starts every restart from the same responsibilities (all ones), so "
                             f"restarts = {self.restarts} would repeat one fit: set train.restarts = 1")
        return self

    @model_validator(mode="after")
    def _every_ranking_trains_a_cluster(self) -> TrainConfig:
        if not self.hard and self.gamma_min > 1 / self.k:
            raise ValueError(f"train.gamma_min = {self.gamma_min} is above 1/k = {1 / self.k:.4g}: a ranking's "
                             "largest responsibility can be as low as 1/k, and such a ranking would train no "
                             f"adapter at all; set train.gamma_min <= {1 / self.k:.4g}")
        return self

    @model_validator(mode="after")
    def _one_start_from_labels(self) -> TrainConfig:
        if self.init == "labels" and self.restarts > 1:
            raise ValueError(f"train.init = labels starts every restart from the same responsibilities, so "
                             f"restarts = {self.restarts} would differ only by their adapters' random "
                             "initialisation: set train.restarts = 1")
        return self

    def identity(self) -> dict[str, Any]:
        """What enters the train version. ``score_batch_size`` and ``device`` do not, unless LoRA
        dropout is on: its masks are drawn pass by pass (so by how rows are grouped into passes) and
        by the device's generator (train.plan_train adds the device type)."""
        volatile = {"score_batch_size", "device", "chunk_size", "gradient_checkpointing"}
        volatile -= {"score_batch_size"} if self.lora_dropout else set()
        if self.anchors in (None, 1):  # nothing to weigh, one stratum
            volatile |= {"anchor_weighting", "anchor_draw"}
        if self.anchor_draw == "uniform":  # as every version before the setting drew
            volatile.add("anchor_draw")
        if self.mixing == "learned":  # as every version before the setting learned them
            volatile.add("mixing")
        return self.model_dump(mode="json", exclude=volatile) | self._as_the_default()

    def _as_the_default(self) -> dict[str, Any]:
        """Settings whose value changes nothing here, versioned as their default's (so that a version
        made with the default keeps its name): the estimation and its check without anchors (nothing
        is estimated), targets named in another order or twice (matched as a set), ``first_epochs`` equal
        to ``epochs``, and any ``gamma_min`` above 0 under hard EM (responsibilities of 0 or 1)."""
        fields = type(self).model_fields
        default = {name: fields[name].default for name in ("estimation", "estimation_check", "lora_targets",
                                                             "first_epochs", "gamma_min")}
        same: dict[str, Any] = {}
        if self.anchors is None:
            same |= {"estimation": default["estimation"], "estimation_check": default["estimation_check"]}
        targets = set(self.lora_targets)  # as the default's list where it is that set, else sorted
        same["lora_targets"] = list(default["lora_targets"]) if targets == set(default["lora_targets"]) else sorted(targets)
        if self.first_epochs == self.epochs:
            same["first_epochs"] = default["first_epochs"]
        if self.hard and self.gamma_min > 0:
            same["gamma_min"] = default["gamma_min"]
        return same
