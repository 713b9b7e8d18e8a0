"""Measures the peak memory (RSS) of python -m jobs.prepare_data against corpus size: 1x, 4x and 16x.

    python scripts/bench/prepare_memory.py [--mb 1] [--doc-per paragraph] [--src CHECKOUT] [--out bench.jsonl]

The corpus is the worst case for memory: plain text without a blank line (one paragraph, so one
document under the default data.doc_per=paragraph), lines of words drawn from a fixed list, generated
deterministically at --mb, 4 x --mb and 16 x --mb megabytes, its words made of syllables so that the distinct
words grow with the corpus (with 120 distinct words the BPE trainer's counts never grew). Each size runs prepare_data (a byte-level BPE
of 512 tokens trained on the corpus, then the tokenization) in a fresh process that reports its own peak
RSS (ru_maxrss) and its RSS after the imports, before reading the corpus (the baseline). Prints the ratio
peak(16x) / peak(1x) (flat is 1.0) and appends one JSON line. --src runs another checkout's code (e.g. the
main branch before the fix) in the child processes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_SYLLABLES = [f"{c}{v}" for c in "bdfgklmnprstvz" for v in "aeiou"] + ["tar", "vel", "dre", "ck", "th", "x"]


def write_corpus(path: Path, *, mb: float, seed: int = 0) -> int:
    """A text file of about `mb` megabytes without any blank line; returns its size in bytes. Words of 1 to 5
    syllables out of 76 (a Zipf-like mix: short words often, long ones mostly new), so that the distinct words
    grow with the corpus as in natural text (a BPE trainer's word counts grow with them)."""
    r, want, size = random.Random(seed), int(mb * 1e6), 0
    with path.open("w") as f:
        while size < want:
            words = (
                "".join(r.choices(_SYLLABLES, k=min(5, int(r.expovariate(0.7)) + 1))) for _ in range(r.randint(5, 20))
            )
            line = " ".join(words) + "\n"
            f.write(line)
            size += len(line)
    return size


def distinct_words(path: Path) -> int:
    words: set[str] = set()
    with path.open() as f:
        for line in f:
            words.update(line.split())
    return len(words)


def child(corpus: str, out: str, doc_per: str, sample_mb: str) -> None:
    """Runs prepare_data once in this process; prints a JSON line of its peak RSS."""
    from jobs.config import DataConfig
    from jobs.data.prepare import prepare_data

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kw = {"doc_per": doc_per} if doc_per != "paragraph" else {}  # an older checkout has no data.doc_per
    if float(sample_mb) > 0:  # nor data.tokenizer_sample_mb
        kw["tokenizer_sample_mb"] = float(sample_mb)
    t0 = time.perf_counter()
    m = prepare_data(
        DataConfig(name="tokenized", path=out, inputs=[corpus], **kw), vocab_size=512, progress=lambda _: None
    )
    print(
        json.dumps(
            {
                "baseline_mib": base / 1024,
                "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "seconds": time.perf_counter() - t0,
                "tokens": m["tokens"] + m["heldout_tokens"],
                "documents": m["documents"] + m["heldout_documents"],
            }
        )
    )


def measure(src: Path, corpus: Path, out: Path, doc_per: str, sample_mb: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, __file__, "--child", str(corpus), str(out), doc_per, str(sample_mb)]
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"prepare_data failed in {src}:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=1.0, help="size of the 1x corpus in megabytes")
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--doc-per", default="paragraph")
    ap.add_argument("--src", type=Path, default=REPO, help="the checkout whose prepare_data is measured")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON line to this file")
    ap.add_argument("--sample-mb", type=float, default=0.0, help="data.tokenizer_sample_mb (0: the checkout's default)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # scripts/bench/ must not shadow the `checkpoint` package (it holds checkpoint.py)
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
        return child(*a.child)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scale in a.scales:
            corpus = Path(tmp) / f"corpus{scale}x.txt"
            size = write_corpus(corpus, mb=a.mb * scale)
            row = {
                "scale": scale,
                "corpus_mb": size / 1e6,
                **measure(a.src, corpus, Path(tmp) / f"out{scale}.h5", a.doc_per, a.sample_mb),
                "distinct_words": distinct_words(corpus),  # after: a child forked from a big parent starts big
            }
            rows.append(row)
            corpus.unlink()
            print(
                f"{scale:>3}x  {row['corpus_mb']:7.1f} MB corpus  peak RSS {row['peak_mib']:7.0f} MiB "
                f"(after imports {row['baseline_mib']:4.0f})  {row['distinct_words']:,} distinct words  "
                f"{row['tokens'] / row['seconds']:,.0f} tokens/s",
                flush=True,
            )
    ratio = rows[-1]["peak_mib"] / rows[0]["peak_mib"]
    print(f"peak RSS {rows[-1]['scale']}x / {rows[0]['scale']}x: {ratio:.2f} (flat = 1.0)")
    line = json.dumps(
        {
            "bench": "prepare_memory",
            "src": str(a.src),
            "doc_per": a.doc_per,
            "sample_mb": a.sample_mb,
            "ratio": ratio,
            "rows": rows,
        }
    )
    print(line)
    if a.out:
        with a.out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
