"""The pre-launch step every launcher shares: the data file, absolute paths and `config.yaml`, once, in one process."""

from __future__ import annotations

from pathlib import Path

from jobs.config import JobConfig

__all__ = ["prepare_inputs", "prepare_run", "config_yaml"]


def config_yaml(cfg: JobConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def prepare_inputs(cfg: JobConfig) -> None:
    """Before the run dir is claimed or touched, in one process: data.path made absolute and the data file
    checked (generated once, never by racing ranks). Raises ValueError when a data file does not match the
    model (its vocabulary: model.vocab_size), so a refused start writes nothing."""
    from jobs.data import ensure_dataset

    cfg.data.path = str(Path(cfg.data.path).resolve())
    for source in cfg.data.sources:
        source.path = str(Path(source.path).resolve())
    ensure_dataset(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        sample_len=cfg.model.max_seq_len + 1,
        eval_sample_len=cfg.train.seq_len + 1 if cfg.train.eval_every else 0,
    )


def prepare_run(cfg: JobConfig) -> Path:
    """After `prepare_inputs` and the run dir's claim: run.dir made absolute, config.yaml written once (a
    later start of the run keeps it)."""
    run_dir = Path(cfg.run.dir).resolve()
    cfg.run.dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if not path.exists():
        path.write_text(config_yaml(cfg))
    return run_dir
