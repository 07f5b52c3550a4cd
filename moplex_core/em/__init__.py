"""Dataset-level EM for a mixture of k Plackett-Luce models (paper Algorithm 2, DESIGN.md 5.3).

The engine knows rankings and posteriors; everything about *how* a cluster scores a response lives
behind the `Scorer` protocol (free item utilities, a linear model, k LoRA adapters on an LM).

One iteration t:
    alpha_c   = mean_i gamma_ic                                  (M-step, mixing weights)
    theta     = argmin - sum_ic w_ic log P_c(sigma_i),  w = gamma * [gamma >= gamma_min]
    gamma_ic  = softmax_c(log alpha_c + log P_c(sigma_i))        (E-step, whole training set)
    LL_t      = mean_i logsumexp_c(log alpha_c + log P_c(sigma_i))

The first M-step starts from symmetry-breaking responsibilities (a seeded Dirichlet, k-means over
the rankings' Fisher-score features, or the posteriors of a linear PL mixture over features in which
the scorer is linear at its start: `linearized`), since scorers start equal (LoRA B = 0 makes every
adapter the reference). Every iteration can be checkpointed to ``<dir>/restart-RR/iter-NNNN/`` and a killed run
resumes at the last finished iteration with identical results; the responsibilities a restart started
from are kept beside them (``<dir>/restart-RR/start.parquet``), so a rerun does not recompute the start
and a reader can see how much of it EM kept.

`types` holds what EM works on (`Rankings`, the `Scorer` protocol, `EMConfig`, `EMState`), `start`
where it starts, `fit` the loop, `checkpoints` its files; every name other modules use is importable
from here.
"""

from moplex_core.em.checkpoints import (
    START_FILE,
    load_last_checkpoint,
    load_start,
    posteriors_table,
    read_posteriors,
    save_checkpoint,
    save_start,
)
from moplex_core.em.fit import (
    LIKELIHOOD_FALL,
    check_finite,
    estimates_off_by,
    fit_mixture,
    likelihood_falls,
    mixture_posteriors,
    posteriors,
)
from moplex_core.em.start import (
    LINEARIZED_ITERATIONS,
    LINEARIZED_L2,
    LINEARIZED_SOLVER,
    initial_responsibilities,
    soft_one_hot,
)
from moplex_core.em.types import EMConfig, EMResult, EMState, Rankings, Scorer

__all__ = [
    "LIKELIHOOD_FALL", "LINEARIZED_ITERATIONS", "LINEARIZED_L2", "LINEARIZED_SOLVER", "START_FILE", "EMConfig",
    "EMResult", "EMState", "Rankings", "Scorer", "check_finite", "estimates_off_by", "fit_mixture",
    "initial_responsibilities", "likelihood_falls", "load_last_checkpoint", "load_start", "mixture_posteriors",
    "posteriors", "posteriors_table", "read_posteriors", "save_checkpoint", "save_start", "soft_one_hot",
]
