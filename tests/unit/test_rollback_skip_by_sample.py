"""A rollback's data skip is a global sample range: a resume with another train.global_batch
reads none of the spiking samples and skips no healthy one; at the same batch size nothing changes."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from checkpoint import TrainState
from jobs.config import DataConfig
from jobs.data import BatchSource, ensure_dataset
from jobs.data.sampler import epoch_samples
from jobs.failure.spike import data_step, skip_entries, skip_ranges
from tests.unit.test_spike import _Fake, _health, _spike_at

SEED, NUM = 5, 2000


@pytest.fixture
def token_file(tmp_path) -> str:
    cfg = DataConfig(path=str(tmp_path / "a.h5"), num_samples=NUM, gen_seed=1)
    ensure_dataset(cfg, vocab_size=32, sample_len=9)
    return cfg.path


def _source(path: str, global_batch: int) -> BatchSource:
    return BatchSource(path, seed=SEED, global_batch=global_batch, seq_len=8, dp_rank=0, dp=1)


def _read(src: BatchSource, records: list[dict], steps: range) -> np.ndarray:
    """The samples steps `steps` read under the rollback records (the trainer's step -> data step map)."""
    entries, src.skips = skip_entries(records), skip_ranges(records)
    return np.concatenate([src.indices(data_step(s, entries))[2] for s in steps])


def _at(*spans: tuple[int, int]) -> np.ndarray:
    pos = np.concatenate([np.arange(a, b) for a, b in spans])
    return epoch_samples(seed=SEED, num_samples=NUM, positions=pos)


def test_a_rollback_records_the_global_samples_its_skipped_data_steps_read(token_file, tmp_path: Path) -> None:
    # The case: target step 90, the spike at steps 98..99 (train_step numbering 97..98 + 1) with a skip
    # of 4 steps: data steps 96..99 at train.global_batch=8 are global samples 768..800.
    h = _health(tmp_path, spike_factor=2.0, spike_window=2, spike_patience=2, spike_skip_steps=4)
    src = _source(token_file, 8)
    h.bind(src)
    st = TrainState()
    at90 = {"step": 90, "tokens_seen": 0, "loss_tail": [], "health": {}}
    fake = _Fake(h, st, {90: at90})
    st.health["detector"] = {"history": [1.0, 1.0], "streak": []}
    cursor90 = src.cursor(90)
    load = fake.load
    fake.load = lambda before: (load(before), src.restore(cursor90))[0]  # the trainer's load restores the cursor
    assert _spike_at(h, fake, [1.0, 5.0, 5.0], start=97)
    (rec,) = h.records
    assert (rec["target_step"], rec["from_step"], rec["skipped_data_steps"]) == (90, 96, [96, 97, 98, 99])
    assert rec["skip_samples"] == [768, 800] and src.skips == [(96, 100, 768, 800)]


def test_a_resume_with_a_larger_global_batch_skips_exactly_the_spiking_samples(token_file) -> None:
    rec = {"from_step": 96, "data_step": 100, "skipped_data_steps": [96, 97, 98, 99], "skip_samples": [768, 800]}
    first = _source(token_file, 8)
    saved = first.cursor(90)  # the target's checkpoint, saved at train.global_batch=8
    # at batch 8 the run reads what it read before the sample range existed: 720..768, then 800..832
    assert np.array_equal(_read(first, [rec], range(90, 100)), _at((720, 768), (800, 832)))
    resumed = _source(token_file, 16)
    resumed.restore(saved)
    got = _read(resumed, [rec], range(90, 100))  # 160 samples: none of 768..800, and no healthy one left out
    assert np.array_equal(got, _at((720, 768), (800, 912)))  # before: steps 93..94 read 768..800, 816..880 left out
    assert resumed.cursor(data_step(100, skip_entries([rec])))["position"] == 912  # step 100 reads on at 912


def test_a_batch_that_a_skipped_range_cuts_reads_on_after_it(token_file) -> None:
    rec = {"from_step": 96, "data_step": 100, "skipped_data_steps": [96, 97, 98, 99], "skip_samples": [770, 802]}
    src = _source(token_file, 16)
    src.restore(_source(token_file, 8).cursor(90))
    assert np.array_equal(_read(src, [rec], range(90, 95)), _at((720, 770), (802, 832)))


def test_a_rollback_record_without_a_sample_range_skips_by_data_step_as_before(token_file) -> None:
    legacy = {"from_step": 96, "data_step": 100, "skipped_data_steps": [96, 97, 98, 99]}
    src = _source(token_file, 8)
    assert skip_ranges([legacy]) == []
    assert np.array_equal(_read(src, [legacy], range(94, 98)), _at((752, 768), (800, 816)))
    assert pickle.loads(pickle.dumps(src.skips)) == []
