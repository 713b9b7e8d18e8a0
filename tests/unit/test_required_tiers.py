"""The required-tier gate of tests/conftest.py, run on a small throwaway suite with pytest's own pytester
(in this process, which reads MESHJOB_REQUIRE_TIERS afresh each time it imports the copied conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

GATE = (Path(__file__).resolve().parent.parent / "conftest.py").read_text()
SUITE = """
import pytest
pytestmark = pytest.mark.slurm
def test_a(): pass
def test_b(): pass
def test_c(): pass
def test_d(): pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeconftest(GATE)
    pytester.makeini("[pytest]\nmarkers =\n    slurm: s\n    chaos: c\n")
    pytester.makepyfile(test_tier=SUITE)
    monkeypatch.setenv("MESHJOB_REQUIRE_TIERS", "slurm")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    return pytester


def test_the_whole_tier_passing_is_a_pass(suite: pytest.Pytester) -> None:
    r = suite.runpytest("-p", "no:cacheprovider")
    assert r.ret == 0, r.stdout.str()
    r.stdout.fnmatch_lines(["*required tier slurm: 4 of 4 collected tests passed*"])


@pytest.mark.parametrize("narrowing", [["-k", "test_a"], ["--deselect", "test_tier.py::test_b"], ["-m", "not slurm"]])
def test_a_partial_or_whole_deselection_of_a_required_tier_fails_the_session(
    suite: pytest.Pytester, narrowing: list[str]
) -> None:
    r = suite.runpytest("-p", "no:cacheprovider", *narrowing)
    assert r.ret == 1, r.stdout.str()
    r.stdout.fnmatch_lines(
        ["*required tier slurm: * of 4 collected tests passed*", "*required tiers did not run in full: slurm*"]
    )


def test_a_skipped_test_of_a_required_tier_fails_the_session(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_skip="import pytest\n@pytest.mark.slurm\ndef test_e(): pytest.skip('no cluster')\n")
    r = suite.runpytest("-p", "no:cacheprovider")
    assert r.ret == 1, r.stdout.str()
    r.stdout.fnmatch_lines(["*required tier slurm: 4 of 5 collected tests passed*"])


def test_an_empty_required_tier_fails_the_session(suite: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.setenv("MESHJOB_REQUIRE_TIERS", "slurm,chaos")
    r = suite.runpytest("-p", "no:cacheprovider")
    assert r.ret == 1, r.stdout.str()
    r.stdout.fnmatch_lines(["*required tier chaos: 0 of 0 collected tests passed*"])


def test_pytests_own_failure_exit_code_is_kept(suite: pytest.Pytester) -> None:
    # A usage error (4: a -k expression that does not parse) and an interrupted session (2) stay what they
    # are, not 1; the gate still says why the tier is short.
    r = suite.runpytest("-p", "no:cacheprovider", "-k", "test_a and (")
    assert r.ret == 4, r.stdout.str()
    r.stdout.fnmatch_lines(["*required tiers did not run in full: slurm*"])
    suite.makepyfile(test_zz="import pytest\n@pytest.mark.slurm\ndef test_x(): raise KeyboardInterrupt\n")
    r = suite.runpytest_subprocess("-p", "no:cacheprovider")  # in this process the interrupt would end the session
    assert r.ret == 2, r.stdout.str()
    r.stdout.fnmatch_lines(["*required tiers did not run in full: slurm*"])
