"""chaos/mutant_catalogue.py stays in step with the code (every mutant still applies), and the runner
applies a mutant in a copy of the checkout, finds the test that catches it and leaves the copy as it was."""

from __future__ import annotations

from dataclasses import replace

from chaos.mutant_catalogue import MUTANTS, TESTS
from chaos.mutants import ROOT, applies, checkout_copy, run_mutant


def test_every_mutant_still_applies_once_and_names_test_modules_that_exist():
    assert len({m.id for m in MUTANTS}) == len(MUTANTS)
    stale = [m.id for m in MUTANTS if applies(m) is None]
    assert not stale, f"their old text is no longer in their file exactly once: update chaos/mutant_catalogue.py {stale}"
    assert all(m.new != m.old for m in MUTANTS)
    mutated = {m.file for m in MUTANTS}
    assert not set(TESTS) - mutated, f"TESTS lists files no mutant mutates (add one, or drop them): {set(TESTS) - mutated}"
    assert not mutated - set(TESTS), f"mutants of files TESTS has no test modules for (add them): {mutated - set(TESTS)}"
    assert not [t for tests in TESTS.values() for t in tests if not (ROOT / "tests" / f"{t}.py").is_file()]


def test_a_mutant_is_applied_in_a_copy_and_killed_by_the_first_test_module_that_fails(tmp_path):
    copy = checkout_copy(tmp_path)
    assert (copy / "moplex_core" / "pl.py").read_bytes() == (ROOT / "moplex_core" / "pl.py").read_bytes()
    observed = next(m for m in MUTANTS if m.id == "P01")  # tied items no longer share a denominator
    result = run_mutant(observed, copy)
    assert result.status == "killed" and result.killed_by == "test_pl" and result.line == applies(observed)
    assert (copy / observed.file).read_bytes() == (ROOT / observed.file).read_bytes()  # put back
    gone = replace(observed, old="text that is in no file")
    assert run_mutant(gone, copy).status == "STALE"
