"""Measures python -m jobs.prepare_data's tokenization with reading overlapped with encoding against the serial path.

    python scripts/bench/prepare_parallel.py [--mb 8] [--runs 3] [--out bench.jsonl]

The corpus: plain text of --mb megabytes, one document per line (data.doc_per=line; lines of words drawn from a
fixed list, as scripts/bench/prepare_memory.py writes them). A byte-level BPE of 512 tokens is trained on it
once and reused (data.tokenizer=), so each run times only the check pass and the tokenization. Each run
prepares the corpus twice in this process, serial (`overlap=False`: reading, encoding and storing take turns in
one thread) and overlapped (the default: `tokenizers`' batch encode in a thread, which releases the GIL, while
this one reads the next batches and stores the last), in alternating order, and checks the two files are the
same bytes. Prints each run's seconds and the ratio serial / overlapped (> 1: faster), their median, and
appends one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # scripts/bench/checkpoint.py would shadow
sys.path.insert(0, str(HERE.parents[1]))  # the `checkpoint` package; the checkout's root goes first


def _write_corpus():
    spec = importlib.util.spec_from_file_location("prepare_memory", HERE / "prepare_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_corpus


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _timed(corpus: Path, out: Path, tok: Path, *, overlap: bool) -> float:
    from jobs.config import DataConfig
    from jobs.data.prepare import prepare_data

    out.unlink(missing_ok=True)
    cfg = DataConfig(name="tokenized", path=str(out), inputs=[str(corpus)], tokenizer=str(tok), doc_per="line")
    t0 = time.perf_counter()
    prepare_data(cfg, vocab_size=512, progress=lambda _: None, overlap=overlap)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="corpus size in megabytes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="append the JSON line to this file")
    a = ap.parse_args()
    from jobs.config import DataConfig
    from jobs.data.prepare import prepare_data

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus, tok = Path(tmp) / "corpus.txt", Path(tmp) / "tok.h5"
        size = _write_corpus()(corpus, mb=a.mb)
        m = prepare_data(
            DataConfig(name="tokenized", path=str(tok), inputs=[str(corpus)], doc_per="line"),
            vocab_size=512,
            progress=lambda _: None,
        )
        tokens = m["tokens"] + m["heldout_tokens"]
        for run in range(a.runs):
            order = [False, True] if run % 2 == 0 else [True, False]
            secs = {o: _timed(corpus, Path(tmp) / f"{o}.h5", tok, overlap=o) for o in order}
            same = _sha(Path(tmp) / "False.h5") == _sha(Path(tmp) / "True.h5")
            row = {
                "run": run + 1,
                "serial_s": secs[False],
                "overlapped_s": secs[True],
                "ratio": secs[False] / secs[True],
                "same_bytes": same,
            }
            rows.append(row)
            print(
                f"run {run + 1}: serial {secs[False]:.2f} s, overlapped {secs[True]:.2f} s, ratio {row['ratio']:.2f} "
                f"({tokens / secs[True]:,.0f} tokens/s overlapped), same bytes: {same}",
                flush=True,
            )
    ratio = statistics.median(r["ratio"] for r in rows)
    print(
        f"{size / 1e6:.1f} MB corpus, {tokens} tokens, {len(os.sched_getaffinity(0))} core(s): serial / overlapped "
        f"= {ratio:.2f} (median of {len(rows)} runs; > 1 is faster)"
    )
    line = json.dumps(
        {
            "bench": "prepare_parallel",
            "corpus_mb": size / 1e6,
            "tokens": tokens,
            "cores": len(os.sched_getaffinity(0)),
            "ratio": ratio,
            "rows": rows,
        }
    )
    print(line)
    if a.out:
        with a.out.open("a") as f:
            f.write(line + "\n")
    if not all(r["same_bytes"] for r in rows):
        raise SystemExit("the overlapped and the serial path wrote different bytes")


if __name__ == "__main__":
    main()
