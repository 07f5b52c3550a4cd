"""The paper's baselines and ablations as presets of the one engine (DESIGN 7): each method is a few
``key=value`` overrides of a MoPLEx base pipeline config, so every method shares the ingest and tiny
model artifacts; those that keep the generated responses share the augment artifact and one cache,
those with ``augment=null`` (dpo, single_pl, mixture_bt, maxmin_bt, no_aug) a second cache built on
the rankings alone; train and evaluate are each method's (used by moplex_core.experiments.compare and
``moplex experiment compare``)."""

from __future__ import annotations

from dataclasses import dataclass

from moplex_core.config import PipelineConfig, with_overrides

_ORIGINALS_EXACT = ("augment=null", "train.anchors=null")


@dataclass(frozen=True)
class Method:
    name: str
    paper: str  # the row of the paper's tables this method stands for
    overrides: tuple[str, ...]
    description: str

    @property
    def is_mixture(self) -> bool:
        return "train.k=1" not in self.overrides


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("dpo", "DPO", ("train.k=1", "train.restarts=1", "train.likelihood=bt_pairs", *_ORIGINALS_EXACT),
           "one policy, Bradley-Terry over every pair of the original ranking"),
    Method("single_pl", "LiPO (list MLE)", ("train.k=1", "train.restarts=1", *_ORIGINALS_EXACT),
           "one Plackett-Luce policy on the original rankings"),
    Method("mixture_bt", "EM-DPO", ("train.likelihood=bt_pairs", *_ORIGINALS_EXACT),
           "soft EM over k Bradley-Terry models on the pairs of the original rankings"),
    Method("maxmin_bt", "MaxMin-RLHF", ("train.likelihood=bt_pairs", "train.hard=true", "train.mixing=uniform",
                                        "train.backtracks=0", *_ORIGINALS_EXACT),
           "hard EM over k Bradley-Terry models on pairs, each ranking to the cluster whose model gives it the "
           "highest likelihood"),
    Method("moplex", "MoPLEx (Alg. 2)", (), "k Plackett-Luce models on augmented rankings, a anchors"),
    Method("no_pl", "w/o Plackett-Luce models", ("train.likelihood=bt_pairs",),
           "MoPLEx with Bradley-Terry over pairs of the augmented rankings"),
    Method("no_aug", "w/o generated responses", ("augment=null",),
           "MoPLEx on the original rankings (a anchors of their m responses; every response exact where a >= m)"),
    Method("k1", "w/o mixture models", ("train.k=1", "train.restarts=1"), "MoPLEx with a single cluster"),
    Method("full", "w/o gradient estimation", ("train.anchors=null",), "MoPLEx with every response exact (a = m')"),
    Method("guarded", "MoPLEx + exact fallback (not in the paper)", ("train.exact_fallback=0.5",),
           "MoPLEx that computes every response exactly once an E-step's estimates are off by more than half "
           "the spread of the exact scores (train.exact_fallback)"),
)}


def method_config(base: PipelineConfig, method: str, seed: int) -> PipelineConfig:
    """``base`` turned into ``method`` with ``train.seed = seed``; the evaluation names the method. A
    method without the generated responses that keeps the anchors (``no_aug``) computes every response
    exactly where the base's a is at least the m originals (Persona: a = 6 of m' = 26, m = 2); on a
    generic source, whose m the config does not tell, the train stage checks a against the data."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if base.augment is None or base.train.anchors is None:
        raise ValueError("the base config must be MoPLEx itself (the methods are differences from it): "
                         "set augment (generated responses) and train.anchors (a < m')")
    overrides = list(METHODS[method].overrides)
    if "augment=null" in overrides and "train.anchors=null" not in overrides:
        m = with_overrides(base, _ORIGINALS_EXACT).responses_per_example()
        if m is not None and base.train.anchors >= m:
            overrides.append("train.anchors=null")
    return with_overrides(base, [*overrides, f"train.seed={seed}", f"evaluate.method={method}"])
