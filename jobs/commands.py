"""The meshjob commands: name, module, the `--help` text each prints (what it does, its main keys, two examples),
and the KEY=VALUE arguments of the commands that take keys of their own (`status`, `report`, `sbatch`)."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jobs import exitcodes

__all__ = ["Command", "COMMANDS", "OWN_KEYS", "help_text", "own_keys", "run_dir_args"]

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
    overrides: bool = True  # takes config overrides (else only its own keys, OWN_KEYS)


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
        "[run.dir=]RUN_DIR",
        "every attempt of a run, and its Slurm state",
        "Every attempt of a live or finished run: when, how it ended, steps gained, suspects, and the Slurm "
        "state of its jobs.",
        ("run.dir=RUN_DIR               a run directory (it holds events.jsonl); `run.dir=` may be left out",),
        ("status runs/20260101-120000", "status run.dir=/lustre/meshjob/runs/llama3_8b"),
        overrides=False,
    ),
    Command(
        "report",
        "jobs.report",
        "[run.dir=]RUN_DIR [report.out=DIR] [report.plan=false]",
        "goodput, restarts, phases: text, plots, HTML",
        "Goodput, restarts and their causes, per-rank phases and stragglers of a run; writes plots and one "
        "HTML page (needs the [report] extra: matplotlib).",
        (
            "run.dir=RUN_DIR               a run directory (it holds events.jsonl); `run.dir=` may be left out",
            "report.out=DIR                where the plots and report.html go (default RUN_DIR/report)",
            "report.plan=false             skip the expected goodput from the run's config",
        ),
        ("report runs/20260101-120000", "report run.dir=/lustre/meshjob/runs/llama3_8b report.out=/tmp/llama3_report"),
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
        "[sbatch.style=srun|torchrun] [sbatch.out=FILE] [KEY=VALUE ...]",
        "write a standalone sbatch script",
        "Write a standalone sbatch script for the composed config, for sites that submit with plain sbatch.",
        (
            "sbatch.style=srun|torchrun    one Slurm task per rank (as launcher=slurm), or one torchrun per node",
            "sbatch.out=FILE               write the script there and create RUN_DIR/slurm (else to stdout)",
            "KEY=VALUE                     the same overrides as train (launcher=slurm cluster=<profile> run.dir=)",
        ),
        (
            "sbatch launcher=slurm cluster=h100_ib +experiment=llama3_8b run.dir=/lustre/meshjob/runs/a sbatch.out=a.sbatch",
            "sbatch sbatch.style=torchrun launcher=slurm cluster=h100_ib +experiment=llama3_8b run.dir=/lustre/meshjob/runs/b",
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


# The keys a command reads itself (not config keys: status and report compose no config, and sbatch's are not
# passed to the ranks), with their types. For status and report a bare RUN_DIR is run.dir=RUN_DIR.
OWN_KEYS: dict[str, dict[str, type]] = {
    "status": {"run.dir": str},
    "report": {"run.dir": str, "report.out": str, "report.plan": bool},
    "sbatch": {"sbatch.style": str, "sbatch.out": str},
}
# The flags report and sbatch took before every command took KEY=VALUE: read still, with a deprecation warning.
# flag -> (key, the key's value for a flag without one; None: the flag takes the next argument)
_OLD_FLAGS: dict[str, dict[str, tuple[str, str | None]]] = {
    "report": {"--out": ("report.out", None), "--no-plan": ("report.plan", "false")},
    "sbatch": {"--style": ("sbatch.style", None), "-o": ("sbatch.out", None), "--output": ("sbatch.out", None)},
}


def _value(key: str, text: str, kind: type) -> object:
    if kind is not bool:
        return text
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise ValueError(f"{key}={text}: {text!r} is not a bool (true or false)")


def _unknown(command: str, arg: str) -> ValueError:
    keys = OWN_KEYS[command]
    close = difflib.get_close_matches(arg.split("=")[0].lstrip("-+"), keys, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return ValueError(f"unknown argument {arg!r} for meshjob {command}: {hint}(its keys: {', '.join(keys)})")


def _old_flags(command: str, argv: Sequence[str]) -> list[str]:
    """`argv` with the deprecated flags turned into KEY=VALUE, each named once on stderr."""
    flags, out, args = _OLD_FLAGS.get(command, {}), [], iter(argv)
    for arg in args:
        flag, eq, inline = arg.partition("=")
        if flag not in flags:
            out.append(arg)
            continue
        key, fixed = flags[flag]
        value = fixed if fixed is not None else (inline if eq else next(args, None))
        if value is None:
            raise ValueError(f"{flag} needs a value: use {key}=VALUE")
        print(f"warning: meshjob {command} {flag} is deprecated: use {key}={value}", file=sys.stderr)
        out.append(f"{key}={value}")
    return out


def own_keys(command: str, argv: Sequence[str]) -> tuple[dict[str, object], list[str]]:
    """(the command's own keys that `argv` sets, typed; the rest of `argv`: config overrides, for a command that
    takes them). ValueError naming the argument and the closest key for an unknown one, a flag, a wrong type."""
    keys, composes = OWN_KEYS[command], next(c for c in COMMANDS if c.name == command).overrides
    given: dict[str, object] = {}
    rest: list[str] = []
    for arg in _old_flags(command, argv):
        key, eq, text = arg.partition("=")
        if eq and key in keys:
            given[key] = _value(key, text, keys[key])
        elif not eq and "run.dir" in keys and "run.dir" not in given and not arg.startswith("-"):
            given["run.dir"] = arg
        elif composes and not arg.startswith("-") and not key.lstrip("+").startswith(f"{command}."):
            rest.append(arg)
        else:
            raise _unknown(command, arg)
    return given, rest


def run_dir_args(command: str, argv: Sequence[str], help_hint: str) -> tuple[dict[str, object], Path] | int:
    """The own keys and the run dir of a command that reads one (`status`, `report`), or the exit code once the
    help (0) or an error naming what is wrong (2) is printed: an unknown key, no run dir, a folder without
    `events.jsonl`."""
    if "--help" in argv or "-h" in argv:
        print(help_text(command))
        return exitcodes.OK
    try:
        keys, _ = own_keys(command, argv)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if "run.dir" not in keys:
        print(f"usage: meshjob {command} [run.dir=]RUN_DIR (--help: {help_hint})", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    run_dir = Path(str(keys["run.dir"]))
    if not (run_dir / "events.jsonl").exists():
        print(f"error: {run_dir}/events.jsonl not found: not a meshjob run dir", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    return keys, run_dir
