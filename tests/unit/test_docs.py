"""The docs stay navigable and true: every relative link in README.md and docs/*.md resolves (the file exists, an
`#anchor` is a heading of the target by GitHub's slug rules), and docs/configuration.md is what
scripts/config_reference.py renders from the config dataclasses now."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tests.conftest import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _reference_script():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`
    (github/cmark-gfm's and html-pipeline's TOC filter rule; markup such as backticks is punctuation too)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `#` comment inside a ```bash block is not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(path: Path) -> list[str]:
    """The link targets of a Markdown file outside code blocks, but those to other sites (https:, mailto:)."""
    prose = "\n".join(prose_lines(path.read_text()))  # a link's text may wrap onto the next line
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t)]


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Each relative link of a Markdown file that does not resolve, with why (paths shown relative to root)."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{path.relative_to(root)}: {target} (no file {file_part})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{path.relative_to(root)}: {target} (no heading #{anchor} in {file_part or path.name})")
    return broken


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "sbatch" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_github_slugs_follow_githubs_rules_for_code_punctuation_and_ellipses() -> None:
    assert (
        github_slug("Mixture of experts: `model=tiny_moe` and `mesh.ep`")
        == "mixture-of-experts-modeltiny_moe-and-meshep"
    )
    assert github_slug("Staying up: what happens when…") == "staying-up-what-happens-when"
    assert github_slug("Exit codes (`jobs/exitcodes.py`)") == "exit-codes-jobsexitcodespy"


def test_the_link_checker_reports_a_missing_file_and_a_missing_anchor(tmp_path) -> None:
    (tmp_path / "a.md").write_text("# Title\n## Two words\n```bash\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#two-words) [gone](nothere.md) [a\nwrapped](a.md#not-a-heading) [self](#b) [web](https://x.org)\n# B\n"
    )
    assert broken_links(page, tmp_path) == [
        "b.md: nothere.md (no file nothere.md)",
        "b.md: a.md#not-a-heading (no heading #not-a-heading in a.md)",
    ]


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    files = doc_files()
    assert len(files) >= 14, [f.name for f in files]  # the two READMEs and the docs
    assert sum(len(relative_links(f)) for f in files) >= 60  # the checker sees the links (none lost in parsing)
    broken = [b for f in files for b in broken_links(f)]
    assert broken == []


def test_every_doc_page_is_linked_from_the_readme() -> None:
    linked = {t.partition("#")[0] for t in LINK.findall((REPO / "README.md").read_text())}
    assert sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md") if f"docs/{p.name}" not in linked) == []


def test_the_configuration_reference_matches_the_config_dataclasses() -> None:
    script = _reference_script()
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == script.render(), f"docs/configuration.md is stale: run `{script.REGENERATE}` and commit it"


def test_the_configuration_reference_lists_every_key_with_its_type_default_and_doc() -> None:
    text = _reference_script().render()
    assert "| `mesh.tp` | `int` | `1` | tensor-parallel degree |" in text
    assert "| `model.dim` | `int` | required | hidden size |" in text
    assert "| `checkpoint.memory_replicas` | `int \\| None` | `null` |" in text
    assert '| `failure.requeue_signals` | `list[str]` | `["SIGUSR2", "SIGTERM"]` | save, then requeue |' in text
    # a comment above the field (no room beside it) is its doc
    assert "| `cluster.gpu_attention_tflops` | `float` | `0.0` | achieved TFLOP/s of the attention kernel" in text
    assert "| `data.sources[].weight` | `float` | `1.0` |" in text
    assert "Options (`mesh=NAME`): `local` (default), `single`." in text
    rows = [l for l in text.splitlines() if l.startswith("| `")]
    assert all(not l.endswith("|  |") for l in rows), [l for l in rows if l.endswith("|  |")]


def test_the_readme_opens_with_the_two_set_up_commands_and_ci_runs_the_second() -> None:
    """The contract of the README's first two code blocks: one installs and trains the embedded default, one
    installs the test dependencies and runs the suite; `.ci/run` runs the second (its install, then pytest)."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)
    commands = [[l for l in b.splitlines() if l.strip() and not l.startswith("#")] for b in blocks[:2]]
    install = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
    assert commands == [
        [f"{install} -e . && python -m jobs.train"],
        [f"{install} -e '.[dev]' && python -m pytest"],
    ]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert f"{install} -e '.[dev]'" in ci and ci[-1] == "python -m pytest", ci


def test_no_comment_or_doc_cites_an_issue_number_a_reader_cannot_resolve() -> None:
    # The tracker's issue numbers mean nothing outside it: a comment says the fact, or cites the repo or a public
    # source (an upstream issue as owner/repo#N). Seven came back with one round of branches after a sweep.
    cited = re.compile(r"\bissues? \d+|\(issue|\bitem \d+\b", re.IGNORECASE)
    roots = ["jobs", "parallel", "checkpoint", "scripts", "tests", "docs", "conf", "sbatch", "hydra_plugins"]
    files = [p for r in roots for p in (REPO / r).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".in")]
    found = [
        f"{p.relative_to(REPO)}:{n}"
        for p in [*files, REPO / "README.md"]
        if p.name != "test_docs.py"
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if cited.search(line)
    ]
    assert not found, found


def test_the_product_reads_only_the_documented_test_seams() -> None:
    # Faults are injected from outside the job wherever the real thing can happen here; a seam in the product only
    # where it cannot, one per kind, each in docs/fault-tolerance.md's table of them.
    seams = {
        m
        for r in ["jobs", "parallel", "checkpoint", "hydra_plugins", "conf", "sbatch"]
        for p in (REPO / r).rglob("*")
        if p.suffix in (".py", ".yaml", ".in")
        for m in re.findall(r"MESHJOB_TEST_[A-Z_]+", p.read_text())
    }
    assert seams == {"MESHJOB_TEST_FLIP_GRAD", "MESHJOB_TEST_CORRUPT_DATA_STEP", "MESHJOB_TEST_SLOW_PHASE"}, seams
    section = (REPO / "docs/fault-tolerance.md").read_text().split("### Test seams")[1].split("\n### ")[0]
    assert all(f"`{s}`" in section for s in seams)
