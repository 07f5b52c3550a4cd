"""EM's files: posteriors as Parquet, each restart's start, per-iteration checkpoints
(``restart-RR/iter-NNNN/``) that a killed run resumes from exactly, and the record (run.json) that
keeps one run from resuming another's."""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moplex_core.artifacts import atomic_path
from moplex_core.em.types import EMConfig, EMState, Rankings


def claim_checkpoint_dir(checkpoint_dir: Path, config: EMConfig, rankings: Rankings,
                          warm_start: torch.Tensor | None) -> None:
    """Record what the checkpoints belong to (run.json) and refuse to resume someone else's run."""
    data = hashlib.sha256(rankings.tiers.numpy().tobytes())
    if rankings.ranked_prefix is not None:
        data.update(rankings.ranked_prefix.numpy().tobytes())
    data.update(json.dumps([rankings.model, rankings.example_ids]).encode())
    warm = None if warm_start is None else \
        hashlib.sha256(warm_start.to(torch.float64).contiguous().numpy().tobytes()).hexdigest()
    identity = {"config": _config_record(config), "n": len(rankings), "rankings_sha256": data.hexdigest(),
                "warm_start_sha256": warm}
    run_file = checkpoint_dir / "run.json"
    if run_file.exists():
        recorded = json.loads(run_file.read_text())
        if recorded != identity:
            changed = sorted(key for key in identity if recorded.get(key) != identity[key])
            raise ValueError(
                f"{checkpoint_dir} holds EM checkpoints of another run (different {', '.join(changed)}); "
                "resuming would mix the two. Use a new checkpoint directory or delete this one."
            )
        return
    with atomic_path(run_file) as tmp:
        tmp.write_text(json.dumps(identity, indent=2))



def _config_record(config: EMConfig) -> dict[str, Any]:
    """``config`` as run.json records it, so that a run the train version calls the same resumes:
    ``mixing`` only where it is not ``learned`` (records before the setting have none), and a
    ``gamma_min`` that changes nothing (any above 0 under hard EM) as its default."""
    record = asdict(config)
    if config.mixing == "learned":
        del record["mixing"]
    if config.hard and config.gamma_min > 0:
        record["gamma_min"] = EMConfig.__dataclass_fields__["gamma_min"].default
    return record


START_FILE = "start.parquet"


def posteriors_table(example_ids: tuple[str, ...] | None, gamma: torch.Tensor) -> pa.Table:
    """Responsibilities float64 [n, k] as (example_id, gamma, assigned); ids "0".."n-1" when None."""
    ids = list(example_ids) if example_ids is not None else [str(i) for i in range(gamma.shape[0])]
    return pa.table({
        "example_id": pa.array(ids, pa.string()),
        "gamma": pa.array(gamma.tolist(), pa.list_(pa.float64())),
        "assigned": pa.array(gamma.argmax(1).tolist(), pa.int32()),
    })


def read_posteriors(path: Path, example_ids: tuple[str, ...] | None = None) -> torch.Tensor:
    """A `posteriors_table` file as float64 [n, k], checked against ``example_ids`` (same order) when given."""
    table = pq.read_table(path, columns=["example_id", "gamma"]).to_pydict()
    if example_ids is not None and tuple(table["example_id"]) != tuple(example_ids):
        raise ValueError(f"{path} holds posteriors of other rankings than these ({len(table['example_id'])} "
                         f"ids against {len(example_ids)}, or in another order)")
    return torch.tensor(table["gamma"], dtype=torch.float64)


def save_start(restart_dir: Path, gamma: torch.Tensor, example_ids: tuple[str, ...] | None) -> Path:
    """Write the responsibilities a restart starts from (``restart_dir/start.parquet``, atomically)."""
    restart_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(restart_dir / START_FILE) as tmp:
        pq.write_table(posteriors_table(example_ids, gamma), tmp)
    return restart_dir / START_FILE


def load_start(restart_dir: Path, example_ids: tuple[str, ...] | None) -> torch.Tensor | None:
    """The start `save_start` wrote for this restart, or None when there is none yet."""
    path = restart_dir / START_FILE
    if not path.is_file():
        return None
    return read_posteriors(path, example_ids)


def save_checkpoint(
    restart_dir: Path,
    state: EMState,
    example_ids: tuple[str, ...] | None,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``iter-NNNN/`` (posteriors.parquet, state.pt, ``extra_files(iter_dir)``, then state.json
    last) atomically, then delete the earlier iterations' state.pt: only the last whole iteration's is
    needed to resume, and with a large model each is gigabytes (adapters and both Adam moments)."""
    it_dir = restart_dir / f"iter-{state.iteration:04d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(it_dir / "posteriors.parquet") as tmp:
        pq.write_table(posteriors_table(example_ids, state.gamma), tmp)
    payload = {"gamma": state.gamma, "alpha": state.alpha, "scorer": state.scorer_state}
    with atomic_path(it_dir / "state.pt") as tmp:
        torch.save(payload, tmp)
    if extra_files is not None:
        extra_files(it_dir)
    summary = {
        "restart": state.restart,
        "iteration": state.iteration,
        "alpha": state.alpha.tolist(),
        "log_likelihood": state.log_likelihood,
        "history": state.history,
        "step_halvings": state.halvings,
        "converged": state.converged,
    }
    with atomic_path(it_dir / "state.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2))
    keep_only_the_last_state(restart_dir, it_dir)
    return it_dir


def keep_only_the_last_state(restart_dir: Path, last: Path) -> None:
    """Delete every iteration's state.pt but ``last``'s: a resume needs the last whole iteration's only."""
    for older in restart_dir.glob("iter-*/state.pt"):
        if older.parent != last:
            older.unlink()


def load_last_checkpoint(restart_dir: Path) -> EMState | None:
    """The last iteration whose state.json exists (written last, so the iteration is whole)."""
    if not restart_dir.is_dir():
        return None
    done = sorted((p.parent for p in restart_dir.glob("iter-*/state.json")), key=lambda d: int(d.name[5:]))
    if not done:
        return None
    summary = json.loads((done[-1] / "state.json").read_text())
    payload = _load_state(done[-1] / "state.pt", restart_dir)
    return EMState(
        restart=summary["restart"],
        iteration=summary["iteration"],
        gamma=payload["gamma"],
        alpha=payload["alpha"],
        history=summary["history"],
        converged=summary["converged"],
        scorer_state=payload["scorer"],
        halvings=summary["step_halvings"],
    )


def _load_state(path: Path, restart_dir: Path) -> dict[str, Any]:
    """A state.pt as `save_checkpoint` wrote it: tensors, numbers, strings, None, lists, tuples and dicts
    (every scorer's ``state_dict`` and RoutedAdam's hold nothing else), unpickled with ``weights_only=True``
    so that a file of any other content, in an artifact root from elsewhere, is refused before it runs code."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{path} holds not only tensors, numbers, strings, lists and dicts, which is all an EM checkpoint "
            "holds; moplex does not unpickle anything else, since unpickling runs whatever code the file names. "
            f"Do not resume from an artifact root you do not trust; delete {restart_dir} and rerun to redo this "
            "restart from its start."
        ) from error
