"""matplotlib and tokenizers are extras ([report], [data]; [dev] has both): a rank never imports them, and the
command that needs one names the extra to install when it is missing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jobs import exitcodes
from jobs import prepare_data as prepare_data_command
from jobs.extras import MissingExtra
from jobs.telemetry.run_report import write_report

_RANK_PATH = "jobs.train, jobs.trainer, jobs.launch.rank, jobs.launch.slurm, jobs.launch.local, jobs.evaluate"


def test_the_trainer_path_imports_neither_matplotlib_nor_tokenizers(tmp_path) -> None:
    code = f"import sys, {_RANK_PATH}; print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'matplotlib', 'tokenizers'}}))"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout.strip()) == (0, "[]"), p.stderr[-2000:]


def test_prepare_data_without_tokenizers_names_the_data_extra(monkeypatch, tmp_path, capsys) -> None:
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": f"doc {i} of words"}) + "\n" for i in range(20)))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ModuleNotFoundError
    monkeypatch.chdir(tmp_path)
    code = prepare_data_command.main(["data.inputs=[corpus.jsonl]", "data.path=corpus.h5", "model.vocab_size=384"])
    assert code == exitcodes.ENV_ERROR
    assert (
        "tokenizers is not installed (jobs.prepare_data needs it): pip install 'meshjob[data]'"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "corpus.h5").exists()


def test_the_report_without_matplotlib_names_the_report_extra(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "jobs.telemetry.plots", raising=False)
    with pytest.raises(
        MissingExtra,
        match=r"matplotlib is not installed \(jobs.report's plots needs it\): pip install 'meshjob\[report\]'",
    ):
        write_report(None, tmp_path / "report")
    assert not (tmp_path / "report").exists()
