"""docs/data.md's "two commands": prepare a small corpus and train on it, run exactly as written there."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # 10 steps on one rank: 92 s on 2 busy cores (25 s CPU)


def doc_commands() -> list[list[str]]:
    text = (REPO / "docs" / "data.md").read_text()
    block = re.search(r"<!-- two-commands:.*?-->\n```bash\n(.*?)```", text, re.S)
    assert block, "docs/data.md lost its two-commands block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_the_data_doc_prepares_a_corpus_and_trains_on_it_in_two_commands(tmp_path) -> None:
    r = random.Random(0)
    words = "the river runs past old stone walls where green moss grows in the quiet morning light".split()
    with (tmp_path / "corpus.jsonl").open("w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(r.randint(8, 40)))}) + "\n")
    commands = doc_commands()
    assert [c[:3] for c in commands] == [["python", "-m", "jobs.prepare_data"], ["python", "-m", "jobs.train"]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    outs = [
        subprocess.run([sys.executable, *c[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        for c in commands
    ]
    for p in outs:
        assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "corpus.h5").exists() and "prepare_data: wrote" in outs[0].stderr
    (metrics,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    evals = [m for m in rows if m.get("record") == "eval"]
    assert [m["step"] for m in rows if "record" not in m] == list(range(1, 11))
    assert [e["step"] for e in evals] == [5, 10] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
