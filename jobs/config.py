"""The config schema: one dataclass per config group, registered with Hydra, and the one composition path.

Hydra stops here: `compose()` turns overrides into a plain `JobConfig`; nothing past it sees OmegaConf.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import typing
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from checkpoint.config import CheckpointConfig
from parallel.config import MeshConfig

# conf/ installs as the package jobs._conf (pyproject's package-dir): the same path in a wheel and an editable install
CONF_DIR = Path(str(files("jobs._conf")))
# conf/train.yaml's `hydra.searchpath`: the user's config folder (`user_conf_dir`), searched after CONF_DIR
USER_CONF_RESOLVER = "meshjob.user_conf"
# model.sdpa_backend: the attention kernels F.scaled_dot_product_attention may pick (jobs/models/sdpa.py)
SDPA_BACKENDS = ("auto", "math")
# model.norm_kernel: how RMSNorm runs (jobs/models/model.py)
NORM_KERNELS = ("eager", "fused")


def user_conf_dir() -> Path:
    """The user's own config folder, which composition searches after the package's conf/ (a profile of the same
    name in the package wins): `$XDG_CONFIG_HOME/meshjob` when XDG_CONFIG_HOME is an absolute path (the XDG base
    directory spec), else `~/.config/meshjob`. `cluster=NAME` finds `<it>/cluster/NAME.yaml`; jobs.calibrate writes
    its profiles there (an installed package's conf/ is site-packages: not the user's, and replaced on upgrade)."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".config") / "meshjob"


def _user_searchpath() -> list[str]:
    """`hydra.searchpath` for `user_conf_dir()`: empty while the folder does not exist (Hydra warns of a missing one)."""
    d = user_conf_dir()
    return [f"file://{d}"] if d.is_dir() else []


@dataclass
class ModelConfig:
    name: str = MISSING  # preset name, e.g. tiny, llama3_8b
    dim: int = MISSING  # hidden size
    n_layers: int = MISSING  # transformer blocks
    n_heads: int = MISSING  # query heads
    n_kv_heads: int = MISSING  # key/value heads (grouped-query attention); = n_heads for MHA
    vocab_size: int = MISSING  # tokens in the vocabulary
    ffn_dim: int = MISSING  # SwiGLU hidden size
    norm_eps: float = 1e-5  # RMSNorm epsilon
    norm_kernel: str = "eager"  # eager (our RMSNorm's elementwise ops) | fused (F.rms_norm: torch's fused RMSNorm kernels on CUDA; the same elementwise ops on CPU)
    rope_theta: float = 10000.0  # RoPE base
    max_seq_len: int = 2048  # longest sequence RoPE tables are built for
    # Mixture of experts (DeepSeek-V3 style; jobs/models/moe.py trains it, jobs.plan plans it).
    n_routed_experts: int = 0  # routed experts per MoE layer; 0 = dense model
    n_shared_experts: int = 0  # always-active shared experts per MoE layer
    experts_per_token: int = 0  # routed experts each token is sent to (top-k)
    moe_ffn_dim: int = 0  # SwiGLU hidden size of one expert
    n_dense_layers: int = 0  # leading blocks with a dense FFN (ffn_dim) before the MoE blocks
    moe_max_nodes: int = 0  # node-limited routing: a token's routed experts lie on at most this many nodes (DeepSeek-V3: 4); 0 = unlimited
    moe_groups: int = 0  # contiguous expert groups the node limit counts, one per node the experts span (DeepSeek-V3 n_group: 8); 0 = 1
    moe_score_func: str = "softmax"  # router scores: softmax | sigmoid (DeepSeek-V3)
    moe_route_norm: bool = False  # DeepSeek-style: the top-k weights are normalised to sum to 1 (always with sigmoid)
    moe_route_scale: float = 1.0  # routed output scale after normalisation (DeepSeek-V3 routed_scaling_factor: 2.5)
    moe_bias_rate: float = 1.0e-3  # aux-loss-free balancing: expert bias += rate * sign(mean load - load) per step (DeepSeek-V3 gamma); 0 = off
    moe_aux_loss_coef: float = 0.0  # sequence-wise balance loss weight (DeepSeek-V3 alpha: 1e-4); 0 = off
    # Attention: grouped-query (Llama) or multi-head latent attention (DeepSeek-V2/V3, analytic only).
    attention: str = "gqa"  # gqa | mla
    sdpa_backend: str = "auto"  # auto (torch picks flash / memory-efficient / cuDNN) | math (torch's math backend: the scores materialised, in the compute dtype)
    q_lora_rank: int = 0  # MLA query compression rank; 0 = no query compression
    kv_lora_rank: int = 0  # MLA key/value compression rank
    qk_nope_head_dim: int = 0  # MLA per-head query/key dims without RoPE
    qk_rope_head_dim: int = 0  # MLA per-head query/key dims with RoPE (the key part is shared by all heads)
    v_head_dim: int = 0  # MLA per-head value dims


@dataclass
class DataSource:
    path: str = MISSING  # a tokenized HDF5 token file (python -m jobs.prepare_data)
    weight: float = 1.0  # relative share of the global batch drawn from it


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic (generated on first use) | tokenized (made by python -m jobs.prepare_data)
    path: str = "data/synthetic-v2.h5"  # HDF5 token file: read by the trainer, written by jobs.prepare_data
    num_samples: int = 4096  # synthetic: samples (rows) generated into the file
    gen_seed: int = 1234  # synthetic: seed of the language (not of training)
    heldout_fraction: float = 0.05  # share of documents (synthetic: of rows) kept out of training for evaluation
    sources: list[DataSource] = field(
        default_factory=list
    )  # tokenized: a weighted mixture of files; empty = data.path alone
    inputs: list[str] = field(default_factory=list)  # jobs.prepare_data: text or JSON-lines files to tokenize
    tokenizer: str | None = (
        None  # jobs.prepare_data: a tokenizer.json or a prepared .h5 (its tokenizer); None = train a byte-level BPE of model.vocab_size tokens
    )
    doc_per: str = (
        "paragraph"  # jobs.prepare_data, plain text: one document per line | paragraph (blank-line separated) | file
    )
    tokenizer_sample_mb: float = 32.0  # jobs.prepare_data: a BPE trained on the inputs sees at most this many MB of them, spread evenly (memory bounded)
    accept_changed_files: bool = False  # resume over a data file whose size or header changed since the checkpoint
    sample_overlap: bool = False  # tokenized: consecutive samples share one token (sample i starts at token i * train.seq_len), so every transition is a target; false: non-overlapping samples of train.seq_len + 1


@dataclass
class OptimConfig:
    name: str = "adamw"  # only adamw
    lr: float = 1e-2  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio after cosine decay
    warmup_steps: int = 3  # linear warmup steps
    weight_decay: float = 0.1  # decoupled weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    fused: bool | None = None  # AdamW kernel: true = fused, false = foreach, null = fused on CUDA, foreach on CPU


@dataclass
class TrainConfig:
    steps: int = 40  # optimizer steps in the run
    seed: int = 0  # seeds init, data order and every RNG
    global_batch: int = 8  # samples per optimizer step, across all dp ranks
    micro_batch: int = 2  # samples per microbatch on one dp rank
    seq_len: int = 32  # tokens per sample
    log_every: int = 1  # log metrics every N steps (and at the last step)
    activation_checkpointing: str = (
        "none"  # none | selective (every ac_every-th block) | full (every block); trainer and planner
    )
    ac_every: int = 2  # selective: checkpoint blocks with (layer + 1) % ac_every == 0
    deterministic: bool = (
        True  # deterministic kernels on CUDA (torch.use_deterministic_algorithms); CPU/gloo already is
    )
    compile: bool = False  # torch.compile each transformer block (parallel/compile.py)
    compile_backend: str = "inductor"  # torch.compile's backend with train.compile=true (torch._dynamo.list_backends())
    device: str = "auto"  # auto | cpu | cuda: where every rank trains (auto: CUDA when torch sees a GPU)
    mixed_precision: str = "auto"  # auto | bf16 | fp32: compute dtype (auto: bf16 on CUDA, fp32 on CPU); params, grads' reduction, optimizer stay fp32
    eval_every: int = 0  # held-out evaluation every N steps (and at the last step); 0 = off
    eval_batches: int = 4  # global batches of the held-out split in each evaluation (always the same ones)


@dataclass
class RunConfig:
    dir: str = MISSING  # the run directory (config, ledger, metrics, checkpoints)
    command: str = ""  # the command line that composed this config (set by the entry point, kept in config.yaml)
    overrides: list[str] = field(default_factory=list)  # its overrides; a sweep point's own (set by the entry point)


@dataclass
class LauncherConfig:
    name: str = "local"  # local | slurm
    nodes: int = 1  # nodes in the job
    spare_nodes: int = (
        0  # slurm: idle nodes allocated besides `nodes`; one takes a failed node's place in the allocation
    )
    tasks_per_node: int = 8  # ranks per node (= GPUs per node on a GPU cluster)
    master_port: int = 0  # rendezvous port; 0 = rank 0 binds one and publishes it in the run dir
    threads_per_rank: int = 0  # torch intra-op threads per rank; 0 = cores / local ranks (at least 1)
    wait: bool = False  # slurm: block after submit until the job ends, relaying progress lines
    array_parallelism: int = 0  # slurm -m sweeps: array elements running at once (sbatch --array=...%N); 0 = all
    signal_delay_s: int = 120  # slurm: USR2 this many seconds before the time limit (save, then requeue)


@dataclass
class ClusterConfig:
    name: str = "local"  # profile name
    partition: str | None = None  # Slurm partition (-p)
    account: str | None = None  # Slurm account (-A)
    qos: str | None = None  # Slurm QOS
    constraint: str | None = None  # Slurm node features (-C)
    gpus_per_node: int = 0  # GPUs per node; 0 = CPU ranks (gloo)
    cpus_per_task: int = 1  # CPUs per rank
    mem_per_node_gb: int | None = None  # --mem per node; None = the partition default
    time_min: int = 60  # wall-time limit of a job, minutes
    run_root: str = "runs"  # shared (parallel) filesystem root for run dirs; run.dir must be under it
    container_image: str | None = None  # container image for srun (pyxis --container-image), if any
    container_mounts: str | None = None  # pyxis --container-mounts
    setup: list[str] = field(
        default_factory=list
    )  # shell lines run in the batch script before srun (module load, venv)
    exclude: str | None = None  # Slurm nodes never to use (-x), e.g. known-bad hosts
    env: dict[str, str] = field(default_factory=dict)  # exported on every rank before init_process_group
    # Hardware facts for `jobs.plan` (each profile cites its sources).
    gpu_mem_gib: float = 0.0  # memory per GPU
    nvlink_domain: int = 1  # GPUs that share the fast intra-node fabric
    intra_node_bw_GBps: float = 0.0  # per-GPU intra-node (NVLink) bandwidth, GB/s
    intra_node_bw_achieved: bool = (
        False  # intra_node_bw_GBps is a bandwidth NCCL achieved (not the line rate): no efficiency applied
    )
    inter_node_bw_GBps: float = 0.0  # one inter-node NIC's (InfiniBand/RoCE) bandwidth per direction, GB/s
    # inter-node NICs per node (each profile cites its count): NCCL spreads a ring's channels over the NICs of the
    # group's ranks on a node; 0 = not known: every inter-node group at one NIC's inter_node_bw_GBps
    node_nics: int = 0
    gpu_bf16_tflops: float = 0.0  # dense bf16 peak per GPU
    # achieved share of gpu_bf16_tflops by a large bf16 GEMM on this GPU model (each profile cites its MAMF row,
    # jobs.planner.hardware.MATMUL_EFFICIENCY_BY_GPU); 0 = the H100 SXM's, said so in the plan
    gpu_matmul_efficiency: float = 0.0
    gpu_hbm_GBps: float = 0.0  # HBM bandwidth per GPU from its datasheet (the memory-bound ops' rate); 0 = not modelled
    gpu_sms: int = 0  # streaming multiprocessors per GPU (communication kernels take some; GEMM tile waves fill them); 0 = not modelled
    # achieved TFLOP/s of the attention kernel (SDPA's flash backend), forward + backward, in the planner's count
    # (causal halved, training = 3 x forward), at its best sequence length (gpu_attention_seq_share gives the others);
    # 0 = attention at the matmul rate
    gpu_attention_tflops: float = 0.0
    # the share of gpu_attention_tflops the kernel reaches at each sequence length, from the same source (interpolated
    # in log2 of the length, the nearest end's outside them); null = the rate at every length (one measured at the
    # model's own length, e.g. the GPU preflight's `gemms` line)
    gpu_attention_seq_share: dict[int, float] | None = None
    fs_write_GBps: float = 1.0  # aggregate checkpoint write bandwidth of the run filesystem, GB/s
    node_mtbf_hours: float = 50000.0  # one node's mean time between failures
    host_copy_GBps: float = 25.0  # per-GPU device-to-host copy bandwidth (the blocking part of an async save)
    pod_gpus: int = (
        0  # GPUs under one non-blocking switch tier (a pod); 0 = not modelled (jobs.plan says which axes cross pods)
    )
    # Measured by `python -m jobs.calibrate` (empty/0 = not measured: the planner falls back to the cited
    # figures above and says so). One name per concept: jobs/planner reads these same keys.
    calibrated: str | None = None  # when and by which command the figures below were measured
    matmul_tflops: dict[str, float] = field(
        default_factory=dict
    )  # dtype (fp32|bf16) -> achieved TFLOP/s per rank, all ranks of a node busy
    collectives: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # "<op>.<intra|inter>" -> {alpha_s, bus_GBps}
    optimizer_ns_per_param: float = 0.0  # AdamW step + grad-norm pass per local parameter element, all ranks busy (jobs.calibrate; 0 = not modelled)
    # host time of one FSDP2 unit per microbatch beyond its collectives (hooks, gather/reduce copies), all ranks busy,
    # by the tp degree of its parameters ("tp1", "tp2": DTensor parameters cost FSDP2 4x more on CPU); jobs.calibrate; {} = not modelled
    fsdp_unit_host_s: dict[str, float] = field(default_factory=dict)
    pp_action_host_s: float = 0.0  # host time of one pipeline schedule action (one stage's forward or backward of a microbatch) beyond its compute and sends (jobs.calibrate; 0 = not modelled)
    fs_fsync_s: float = 0.0  # one write+fsync+rename of a small file on run_root (a checkpoint commit's fixed cost)


@dataclass
class FailureConfig:
    mtbf_node_hours: float = 50000.0  # one node's MTBF; conf/failure sets it to ${cluster.node_mtbf_hours}
    mtbf_job_hours: float | None = None  # the whole job's MTBF, overriding mtbf_node_hours / nodes
    process_share: float = 0.15  # assumed share of failures that kill/hang a rank on a node that answers (RAM tier); conf/failure/default.yaml cites it
    node_share: float = (
        0.77  # assumed share that lose one node (partner tier); the rest (1 - both) loses the allocation (filesystem)
    )
    max_requeues: int = 10  # requeues before the job stops for good; a stop notice after a new checkpoint is free
    restarts_in_allocation: int = (
        3  # a dead/hung rank on a node that answers: ranks restarted inside the job, this often
    )
    node_probe_timeout_s: float = 15.0  # a suspect's node "answers" when a one-task srun step runs on it within this
    quarantine_ttl_h: float = (
        24.0  # a quarantined node is excluded this many hours after it was listed; 0 = until removed
    )
    max_attempts_without_progress: int = 3  # consecutive attempts that commit no new checkpoint before the job stops
    init_timeout_s: float = 600.0  # every process group, from rendezvous until the first step completes
    collective_timeout_s: float = 300.0  # every process group once the first step has completed
    hang_timeout_s: float = 180.0  # watchdog: no step completes in this long (after the first) = a hang incident
    heartbeat_s: float = 2.0  # period of each rank's heartbeat (the rendezvous store; a copy in RUN_DIR/heartbeats/)
    missed_beats: int = (
        5  # a waiting rank names a peer hung once its beat has not changed for this many beats (no TCP reset needed)
    )
    checkpoint_timeout_s: float = (
        1800.0  # watchdog limit of a checkpoint write and of the wait for one (instead of hang_timeout_s)
    )
    requeue_signals: list[str] = field(default_factory=lambda: ["SIGUSR2", "SIGTERM"])  # save, then requeue
    signal_margin_s: float = 30.0  # slack the submit-time check adds to one step + one blocking save
    health_every_s: float = 60.0  # GPU health (NVML) of every rank's GPU at start and this often; 0 = at start only
    health_temp_warn_c: float = 85.0  # a GPU this hot without a thermal clock event: a warning event, no incident
    health_failing_xids: list[int] = field(
        default_factory=lambda: [48, 63, 64, 74, 79, 92, 94, 95, 119, 120]
    )  # XIDs that fail the GPU (others warn)
    spike_factor: float = (
        1.5  # a spike's loss is above this x the baseline of the last spike_window losses (trend removed); 0 = off
    )
    spike_mad_k: float = (
        8.0  # ... and above that baseline + this x their median absolute deviation (trend removed); 0 = ratio only
    )
    spike_window: int = 50  # healthy losses in the running median (the check is armed once it is full)
    spike_grad_norm: float = 0.0  # a global grad norm above this is a spike too, once the window is full; 0 = off
    spike_patience: int = 1  # consecutive spiking steps that trigger a rollback (a non-finite loss: at once)
    spike_skip_steps: int = 4  # data steps skipped per rollback: the spike's and up to this many - 1 before it
    spike_lr_scale: float = 1.0  # the learning rate is multiplied by this at each rollback; 1.0 = unchanged
    max_rollbacks: int = 3  # rollbacks per rollback_window_steps; one more spike stops the run for good (exit 77)
    rollback_window_steps: int = 10000  # the steps max_rollbacks counts over (before the spike); 0 = the whole run
    straggler_ratio: float = 1.1  # a phase this many times its reference (peers' median, own history, baseline) is slow
    straggler_intervals: int = (
        3  # consecutive slow windows (>= 20 steps, jobs.telemetry.stragglers) before a straggler or slowdown event (K)
    )
    straggler_min_diff_s: float = (
        0.005  # and slower by at least this many seconds per step (microsecond phases never count)
    )
    straggler_baseline_root: str = (
        "${cluster.run_root}/baselines"  # healthy runs' phase times per model/mesh/cluster (slowdown check)
    )
    exclude_stragglers: bool = (
        False  # a relative straggler's node goes on the run's quarantine list (next requeue avoids it)
    )
    sdc_rerun: bool = True  # a suspicious step is re-run from the same state before its optimizer step: values that differ = hardware (`sdc`)
    sdc_rtol: float = 0.0  # relative difference between a rank's two runs of a step that counts as different; 0 = any (train.deterministic)
    replica_hash_every: int = (
        0  # mesh.dp_replicate > 1: compare parameter and gradient hashes across replicas every this many steps; 0 = off
    )


@dataclass
class MetricsConfig:
    phase_timing: bool = True  # per-rank phase times to RUN_DIR/telemetry/rank<r>.h5 and the straggler checks
    flush_every_s: float = (
        5.0  # a rank's phase rows go to its HDF5 file at a log interval at most this often (and at the end)
    )
    kernel_every: int = 0  # on a GPU the straggler checks judge 1 step in N (e.g. 10) by its compute kernels' device time (profiled; NCCL's left out); 0 = CUDA event time of every step (the default until a GPU run validates the profiled clock)
    tensorboard: bool = False  # metrics.jsonl's scalars also to RUN_DIR/tensorboard (rank 0; pip install tensorboard)


@dataclass
class PlanConfig:
    json: bool = False  # `python -m jobs.plan`: print one JSON object instead of the tables
    fake_backend: bool = True  # measure per-rank shards with the real parallelize() on a fake process group
    usable_mem_fraction: float = (
        0.9  # share of cluster.gpu_mem_gib a rank may plan to use (context, NCCL, fragmentation)
    )
    restart_overhead_s: float | None = (
        None  # user assumption: failure to first step besides the load; None = run.dir's ledger, else load only
    )
    restart_in_allocation_s: float | None = (
        None  # user assumption: a restart inside the allocation (new srun step, rendezvous, build) besides reading RAM; None = unknown
    )
    save_fixed_s: float | None = (
        None  # user assumption: a save's blocking cost besides moving bytes; None = ledger, else cluster.fs_fsync_s
    )
    min_goodput: float = 0.9  # the expected-goodput check fails below this (Llama 3 reports > 90%)
    search: bool = False  # rank every feasible mesh for the model, world size and cluster (jobs.planner.search)
    search_trainable_only: bool = True  # plan.search: rank only shapes jobs.train builds (its validation accepts); false = also the planned-only ones, marked ~
    # plan.search: rank a context-parallel shape only when the sequence needs it, i.e. when the same mesh with cp=1
    # (its ranks in dp_shard) fits with no AC setting; false = rank every cp
    search_cp_only_when_needed: bool = True
    search_rows: int = 20  # plan.search: ranked rows printed (the config's own row always)
    search_top_k: int = (
        0  # plan.search: write the top K as configs under plan.search_out and print the -m sweep over them
    )
    search_out: str = "plan_search"  # plan.search_top_k: directory of the written configs (search/top<i>.yaml)


@dataclass
class CalibrateConfig:
    out: str | None = (
        None  # `python -m jobs.calibrate` writes here; None = ~/.config/meshjob/cluster/<cluster.name>_calibrated.yaml (updated in place; $XDG_CONFIG_HOME/meshjob/... when set)
    )
    seconds: float = 2.0  # seconds spent timing each figure (medians over repeats)


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)

    @property
    def world_size(self) -> int:
        return self.launcher.nodes * self.launcher.tasks_per_node

    @property
    def world_size_expr(self) -> str:
        return f"launcher.nodes({self.launcher.nodes}) * launcher.tasks_per_node({self.launcher.tasks_per_node})"


def config_hash(cfg: JobConfig) -> str:
    """Hash of the resolved config, run.dir excluded (the same experiment may move or be resumed elsewhere)."""
    resolved = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "run"}
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]


# The meshjob launchers' config nodes (`hydra/launcher=meshjob_local|meshjob_slurm`) by their classes' names:
# composing needs the nodes, not the classes, which only the entry points register (jobs.cli) when they launch.
LAUNCHERS = {
    "meshjob_local": "hydra_plugins.meshjob_local_launcher.MeshjobLocalLauncher",
    "meshjob_slurm": "hydra_plugins.meshjob_slurm_launcher.MeshjobSlurmLauncher",
}


@functools.cache
def register_configs() -> None:
    """Registers the root schema so `conf/train.yaml` is type-checked on composition, the resolver of its
    `hydra.searchpath` (`user_conf_dir`, looked at anew by each composition), and the meshjob launchers' config
    nodes: an editable install hides the `hydra_plugins` namespace from Hydra's plugin scan, so they are stored here
    rather than found (the launcher classes themselves: `jobs.cli.register_launchers`). Once per process: storing
    the schema again (OmegaConf.structured of the whole tree) cost 40-50 ms of every compose."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(USER_CONF_RESOLVER):
        OmegaConf.register_new_resolver(USER_CONF_RESOLVER, _user_searchpath)
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    for name, target in LAUNCHERS.items():
        store.store(group="hydra/launcher", name=name, node={"_target_": target}, provider="meshjob")


def to_job_config(cfg: Any) -> JobConfig:
    """Converts a composed DictConfig into the plain dataclass tree (Hydra's door closes here); a key that is no
    field of the schema (`+train.stepz=5`, or a preset's typo) is refused with the closest valid key."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, JobConfig), type(obj)
    unknown = _unknown_keys(obj)
    if unknown:
        raise ValueError("; ".join(unknown_key_message(k) for k in unknown))
    return obj


def schema_keys(cls: type = JobConfig, prefix: str = "") -> dict[str, type | None]:
    """Every dotted key of the schema: a config dataclass's key maps to its class, any other key to None."""
    keys: dict[str, type | None] = {}
    for name, hint in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        sub = hint if dataclasses.is_dataclass(hint) else None
        keys[prefix + name] = sub
        if sub is not None:
            keys.update(schema_keys(sub, f"{prefix}{name}."))
    return keys


def unknown_key_message(key: str) -> str:
    """`unknown key mesh.tpp; did you mean mesh.tp?`: the closest valid key of the schema (difflib)."""
    leaves = [k for k, sub in schema_keys().items() if sub is None]
    close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "python -m jobs.train --cfg job lists the valid keys"
    return f"unknown key {key}: no such field in the config schema; {hint}"


def _unknown_keys(obj: Any, prefix: str = "") -> list[str]:
    """Dotted keys set on the config dataclasses that are none of their fields (OmegaConf.to_object sets them)."""
    if isinstance(obj, list):
        return [k for i, item in enumerate(obj) for k in _unknown_keys(item, f"{prefix}{i}.")]
    if not dataclasses.is_dataclass(obj):
        return []
    names = [f.name for f in dataclasses.fields(obj)]
    extra = [prefix + k for k in getattr(obj, "__dict__", {}) if k not in names]
    return extra + [k for n in names for k in _unknown_keys(getattr(obj, n), f"{prefix}{n}.")]


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train") -> JobConfig:
    """Composes `conf/` with Hydra overrides, as `python -m jobs.train` would, without running anything."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    check_override_keys(overrides)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return to_job_config(cfg)


def check_override_keys(overrides: list[str] | tuple[str, ...]) -> None:
    """Refuses `mesh.tpp=2` naming the closest valid key (Hydra's own message would suggest `+mesh.tpp=2`):
    a dotted key under a config dataclass must be one of its fields. Config groups and `hydra.*` are Hydra's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = schema_keys()
    unknown = [
        o.key_or_group
        for o in OverridesParser.create().parse_overrides(list(overrides))
        if o.package is None
        and not o.is_delete()
        and keys.get(o.key_or_group.rpartition(".")[0])
        and o.key_or_group not in keys
    ]
    if unknown:
        raise ValueError("; ".join(unknown_key_message(k) for k in unknown))
