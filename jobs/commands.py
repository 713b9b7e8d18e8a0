"""The meshjob commands: name, module, and the `--help` text each prints (what it does, its main keys, two examples)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Command", "COMMANDS", "help_text"]

_OVERRIDES = (
    "Arguments are config overrides, KEY=VALUE (dotted keys of the config; +KEY=VALUE adds a preset such as\n"
    "+experiment=llama3_8b). -m sweeps comma-separated values (KEY=a,b); --cfg job prints the composed config;\n"
    "--hydra-help lists Hydra's own flags. Exit 2 on a config error, naming the key."
)


@dataclass(frozen=True)
class Command:
    name: str  # meshjob <name>
    module: str  # python -m <module>
    usage: str
    title: str  # what `meshjob` lists
    summary: str  # a paragraph
    keys: tuple[str, ...]  # the main keys, one per line
    examples: tuple[str, str]  # after `meshjob `
    overrides: bool = True  # takes config overrides (else its own arguments, described in `keys`)


COMMANDS = (
    Command(
        "train",
        "jobs.train",
        "[KEY=VALUE ...]",
        "train a model, here or on Slurm",
        "Train a model: compose the config, check it, then run the ranks here (launcher=local) or submit them to "
        "Slurm (launcher=slurm) and return.",
        (
            "model=tiny|llama3_8b|...      the model preset (conf/model/)",
            "mesh.pp/dp_shard/tp/cp/ep     parallel degrees; their product is the world size",
            "train.steps, train.global_batch, train.seq_len, optim.lr",
            "launcher=local|slurm, launcher.nodes, launcher.tasks_per_node, cluster=<profile>",
            "data=synthetic|tokenized, data.path     run.dir (the run directory)",
        ),
        (
            "train mesh=single launcher.tasks_per_node=1 train.steps=10",
            "train launcher=slurm cluster=h100_ib +experiment=llama3_8b",
        ),
    ),
    Command(
        "plan",
        "jobs.plan",
        "[KEY=VALUE ...]",
        "check a job before it runs (no GPU)",
        "Check a job before it runs, with no GPU: memory per rank, communication, pipeline bubble, checkpoint "
        "interval and goodput at the full world size. Exit 1 when a check fails.",
        (
            "the same keys as train; cluster=<profile> gives the GPUs and network",
            "plan.json=true                one JSON object instead of the tables",
            "plan.search=true              rank the meshes that fit (plan.search_top_k writes a sweep)",
        ),
        (
            "plan launcher=slurm cluster=h100_ib +experiment=llama3_8b",
            "plan model=llama3_70b cluster=h100_ib plan.search=true",
        ),
    ),
    Command(
        "status",
        "jobs.status",
        "RUN_DIR",
        "every attempt of a run, and its Slurm state",
        "Every attempt of a live or finished run: when, how it ended, steps gained, suspects, and the Slurm "
        "state of its jobs.",
        ("RUN_DIR                       a run directory (it holds events.jsonl)",),
        ("status runs/20260101-120000", "status /lustre/meshjob/runs/llama3_8b"),
        overrides=False,
    ),
    Command(
        "report",
        "jobs.report",
        "RUN_DIR [--out DIR] [--no-plan]",
        "goodput, restarts, phases: text, plots, HTML",
        "Goodput, restarts and their causes, per-rank phases and stragglers of a run; writes plots and one "
        "HTML page (needs the [report] extra: matplotlib).",
        (
            "RUN_DIR                       a run directory (it holds events.jsonl)",
            "--out DIR                     where the plots and report.html go (default RUN_DIR/report)",
            "--no-plan                     skip the expected goodput from the run's config",
        ),
        ("report runs/20260101-120000", "report /lustre/meshjob/runs/llama3_8b --out /tmp/llama3_report"),
        overrides=False,
    ),
    Command(
        "calibrate",
        "jobs.calibrate",
        "[KEY=VALUE ...]",
        "measure this machine into a cluster profile",
        "Measure this machine (matmul, attention, collectives, checkpoint writes) on local ranks and write the "
        "figures into a cluster profile that plan then predicts with.",
        (
            "cluster=<profile>             the profile to start from; written as <profile>_calibrated",
            "model=, train.micro_batch, train.seq_len, train.mixed_precision: the shapes measured",
            "launcher.tasks_per_node       local ranks; calibrate.out: where the profile goes",
        ),
        (
            "calibrate cluster=local launcher.tasks_per_node=2",
            "calibrate cluster=h100_ib model=llama3_8b calibrate.out=h100.yaml",
        ),
    ),
    Command(
        "prepare-data",
        "jobs.prepare_data",
        "data.inputs=[FILES] data.path=OUT.h5 [KEY=VALUE ...]",
        "tokenize a corpus into an HDF5 token file",
        "Tokenize text or JSON-lines files into the HDF5 token file that train reads (data=tokenized); run again "
        "with more inputs to append (needs the [data] extra: tokenizers).",
        (
            "data.inputs=[a.jsonl,b.txt]   the corpus files",
            "data.path=OUT.h5              the token file written",
            "model.vocab_size              the BPE vocabulary trained when data.tokenizer is not set",
        ),
        (
            "prepare-data 'data.inputs=[corpus.jsonl]' data.path=corpus.h5 model.vocab_size=512",
            "prepare-data 'data.inputs=[more.jsonl]' data.path=corpus.h5 model.vocab_size=512",
        ),
    ),
    Command(
        "sbatch",
        "jobs.sbatch",
        "[--style srun|torchrun] [-o FILE] [KEY=VALUE ...]",
        "write a standalone sbatch script",
        "Write a standalone sbatch script for the composed config, for sites that submit with plain sbatch.",
        (
            "--style srun|torchrun         one Slurm task per rank (as launcher=slurm), or one torchrun per node",
            "-o FILE                       write the script there (else to stdout)",
            "KEY=VALUE                     the same overrides as train (launcher=slurm cluster=<profile> run.dir=)",
        ),
        (
            "sbatch launcher=slurm cluster=h100_ib +experiment=llama3_8b run.dir=/lustre/meshjob/runs/a -o a.sbatch",
            "sbatch --style torchrun launcher=slurm cluster=h100_ib +experiment=llama3_8b run.dir=/lustre/meshjob/runs/b",
        ),
    ),
)


def help_text(name: str) -> str:
    """What `meshjob <name> --help` (and `python -m <module> --help`) prints."""
    c = next(c for c in COMMANDS if c.name == name)
    lines = [
        f"usage: meshjob {c.name} {c.usage}",
        f"   or: python -m {c.module} {c.usage}",
        "",
        c.summary,
        "",
        "main keys:" if c.overrides else "arguments:",
        *(f"  {k}" for k in c.keys),
        "",
        "examples:",
        *(f"  meshjob {e}" for e in c.examples),
    ]
    return "\n".join(lines + (["", _OVERRIDES] if c.overrides else []))
