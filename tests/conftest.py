"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    """The tests' tensors are tiny: one thread is several times faster than two on a shared 2-core
    machine (measured up to 8x), and results do not depend on the core count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def temporary_files_in_the_tests_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the code under test puts in the system's temporary folder (a failed vLLM worker's
    exchange folder, kept for its log) goes to the test's own folder, which pytest cleans up."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """The environment as it was before each test (after the session's fixtures set theirs): the
    CLI's `main` sets Prefect variables with setdefault, which would otherwise carry into later tests
    on the same worker."""
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):  # only what changed: other threads may read it meanwhile
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """Small hand-written files in each dataset's raw schema."""
    return FIXTURES


@pytest.fixture(scope="session")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Prefect against a local server of its own for the session: a private PREFECT_HOME, analytics
    off, a temporary database, and a startup timeout that fits a loaded 2-core machine. Yields the
    home. The server is Prefect's test harness (a local subprocess server); leaving it drains the
    log and event workers before the server stops."""
    home = tmp_path_factory.mktemp("prefect-home")
    updates = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        # as `moplex` sets it: once a flow has run here, moplex_core's logs outside a run (another test's)
        # would each warn that they have no run to go to, and fail a test that turns warnings into errors
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    }
    removed = ("PREFECT_API_URL", "PREFECT_PROFILE")
    saved = {name: os.environ.get(name) for name in (*updates, *removed)}
    os.environ.update(updates)
    for name in removed:
        os.environ.pop(name, None)
    import prefect.context
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import without_heartbeats

    # Prefect reads its settings once at import; refresh them in case it was imported earlier.
    prefect.context.refresh_global_settings_context()
    with without_heartbeats(), prefect_test_harness(server_startup_timeout=None):  # as `moplex run` locally
        yield home
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    prefect.context.refresh_global_settings_context()
