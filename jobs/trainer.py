"""The training loop, the file a newcomer reads first: build -> (resume) -> step -> log -> checkpoint.

One step: this dp rank's slice of the global batch -> forward/backward (through the pipeline
schedule when mesh.pp > 1, else microbatch accumulation) -> one all-reduce for the global loss
and grad norm -> clip -> AdamW + LR schedule -> a metrics line on rank 0 -> a checkpoint when due.
The failure hooks (stop signals, the watchdog, the SDC re-run, loss spikes) sit behind one object,
`self.resilience` (jobs/failure/resilience.py), called at fixed points of the step.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from checkpoint import CheckpointManager, TrainState, failures_in_ledger, job_mtbf_s
from checkpoint.tiers import tier_shares, tiers_on
from jobs.config import JobConfig, OptimConfig, config_hash
from jobs.data import BatchSource, sources_of
from jobs.device import rank_device
from jobs.evaluate import HeldoutEval
from jobs.events import EventLog, read_events
from jobs.failure.resilience import Resilience
from jobs.failure.signals import StopSignals
from jobs.failure.watchdog import Watchdog
from jobs.launch.domain import failure_domain, topology_path
from jobs.launch.env import DistEnv
from jobs.launch.rundir import run_id
from jobs.log import get_logger
from jobs.models.model import Transformer, init_weights
from jobs.models.moe import BALANCE_FIELDS, moe_layer_ids, moe_layers, set_aux_loss_scale, update_expert_bias
from jobs.telemetry import PeakMemory, achieved, model_flops_per_token
from jobs.telemetry.flops import mfu_text
from jobs.telemetry.rank_telemetry import build_step_telemetry, healthy_run
from jobs.validate import Derived, check_device
from parallel.dims import ParallelDims
from parallel.pipeline import build_schedule
from parallel.recipe import parallelize

# On CPU the live-tensor tracker scans the garbage collector and hooks every op (jobs/telemetry/memory.py):
# a tracked step took 2.9x as long on the default mesh (8 ranks on 2 cores), so only every N-th step is.
MEMORY_SAMPLE_EVERY = 50

__all__ = ["Trainer", "adamw_kernel", "lr_multiplier", "cross_entropy", "stage_grad_sq_norm", "clip_grads_"]


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (a bf16 loss in a collective would mismatch across ranks)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def adamw_kernel(fused: bool | None, device_type: str) -> dict[str, bool]:
    """AdamW's implementation flag for optim.fused: fused (one kernel for all tensors) when asked, or
    by default on CUDA; else foreach (the CPU default: equal losses, see tests/multiproc/test_pp_split.py)."""
    use_fused = device_type == "cuda" if fused is None else fused
    return {"fused": True} if use_fused else {"foreach": True}


def build_optimizers(
    parts: list[nn.Module], cfg: OptimConfig, *, device_type: str = "cpu"
) -> list[torch.optim.Optimizer]:
    """One AdamW per model part (a rank may hold several pipeline stages); no decay on norm weights."""
    kernel = adamw_kernel(cfg.fused, device_type)
    opts = []
    for part in parts:
        decay = [p for p in part.parameters() if p.ndim >= 2]
        no_decay = [p for p in part.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        opts.append(torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel))
    return opts


@torch.no_grad()
def stage_grad_sq_norm(parts: list[nn.Module], device: torch.device | None = None) -> torch.Tensor:
    """Squared L2 norm of this rank's stages' gradients, whole over dp/tp (equal on all their ranks).

    DTensor grads are grouped by mesh and each group's norm made whole with `full_tensor()`.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for part in parts:
        for p in part.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for gs in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(gs, norm_type=2.0, foreach=True)
        sq += _whole(norm).double() ** 2
    return sq


@torch.no_grad()
def clip_grads_(parts: list[nn.Module], *, max_norm: float, total_norm: float) -> None:
    """Scales every gradient by max_norm / total_norm when the global norm exceeds `max_norm`."""
    if max_norm <= 0 or total_norm <= max_norm:
        return
    local = [_local(p.grad) for part in parts for p in part.parameters() if p.grad is not None]
    torch._foreach_mul_(local, max_norm / (total_norm + 1e-6))


def _replicate_partial_grads(parts: list[nn.Module]) -> None:
    """Tensor parallel without FSDP leaves sequence-parallel norm grads Partial(sum) and the
    embedding's grad Replicate (the full vocabulary) while its parameter is Shard(0). Put every
    grad on its parameter's placements once here: the Partial ones are reduced (or every optimizer
    step would all-reduce them implicitly, 3 per norm weight on torch 2.13), the Replicate one is sliced locally, which
    frees (tp - 1) / tp of the embedding's gradient until the next backward."""
    for part in parts:
        for p in part.parameters():
            g = p.grad
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(placements=p.placements)


class Trainer:
    """Builds this rank's share of the job from the config and runs the loop."""

    def __init__(
        self,
        cfg: JobConfig,
        derived: Derived,
        env: DistEnv,
        *,
        events: EventLog,
        stop: StopSignals | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.cfg, self.derived, self.env, self.events = cfg, derived, env, events
        self.log = get_logger()
        device_type, self.mixed_precision = check_device(cfg, per_task=True)  # train.device, train.mixed_precision
        self.device = rank_device(device_type, local_rank=env.local_rank)
        dims = derived.dims
        self.mesh = dims.build_mesh(self.device.type)
        # The MoE mesh (parallel/ep.py): dp_shard split into (edp, ep) over the same ranks.
        self.ep_mesh = dims.build_ep_mesh(self.device.type) if dims.ep_enabled else None
        self.pp_group = self.mesh.get_group("pp") if dims.pp_enabled else None
        self.use_loss_parallel = dims.tp_enabled and cfg.mesh.loss_parallel

        self._build_model(cfg, derived)
        self.optimizers = build_optimizers(self.parts, cfg.optim, device_type=self.device.type)
        self.moe_layers = moe_layers(self.parts)
        # The balance loss's gradient as the main loss's: 1 / microbatches (the pipeline schedule scales all itself).
        set_aux_loss_scale(self.moe_layers, 1.0 if dims.pp_enabled else 1.0 / derived.microbatches)
        self.moe_group = self._moe_group()  # the router counts' all-reduce (bias balancing)
        self.moe_balance: torch.Tensor | None = None  # the last step's balance per MoE layer (update_expert_bias)
        if dims.ep_enabled:  # the MoE layers' mesh folded over the attention layers' ranks, said once at start
            self.log.info("meshes: %s", dims.describe_meshes())
        self.memory = PeakMemory(_param_device(self.parts), sample_every=MEMORY_SAMPLE_EVERY)
        self.flops_per_token = model_flops_per_token(cfg.model, seq_len=cfg.train.seq_len)
        # Stop signals, the watchdog, SDC re-runs and loss spikes, called at fixed points of the loop.
        self.resilience = Resilience(
            cfg.failure,
            env,
            mesh=self.mesh,
            events=events,
            run_dir=cfg.run.dir,
            vocab_size=cfg.model.vocab_size,
            stop=stop,
            watchdog=watchdog,
        )
        self.lr_schedulers = self._build_lr_schedulers(cfg)  # the LR schedule times the rollbacks' scale
        self.data, self.heldout = self._build_data(cfg, dims)
        self.state = TrainState()
        self.metrics_path = Path(cfg.run.dir) / "metrics.jsonl"
        # [step, end time, step_time_s] since the last metrics line (goodput)
        self.trained_steps: list[list[float]] = []
        self.ckpt = build_checkpoint_manager(cfg, derived, env, events=events)
        self._build_observers(cfg, env, events)
        self.resilience.attach(  # the mesh and checkpoint groups exist now: failure.init_timeout_s for them all
            parts=self.parts,
            data=self.data,
            load=self._load,
            schedulers=self.lr_schedulers,
            agree=self._agree,
            wait_for_saves=self._wait_for_saves,
            checkpoint_groups=lambda: self.ckpt.process_groups,
        )

    def _build_lr_schedulers(self, cfg: JobConfig) -> list[torch.optim.lr_scheduler.LambdaLR]:
        """One LambdaLR per optimizer: warmup and cosine decay (`lr_multiplier`) times the rollbacks' LR scale."""
        o = cfg.optim
        return [
            torch.optim.lr_scheduler.LambdaLR(
                opt,
                lambda s: (
                    lr_multiplier(
                        s, warmup_steps=o.warmup_steps, total_steps=cfg.train.steps, min_lr_ratio=o.min_lr_ratio
                    )
                    * self.resilience.lr_scale
                ),
            )
            for opt in self.optimizers
        ]

    def _build_data(self, cfg: JobConfig, dims: ParallelDims) -> tuple[BatchSource, HeldoutEval]:
        """This dp rank's training batches and held-out evaluation."""
        positions = self.parts[0].rope_positions  # a cp rank reads its zig-zag chunks' tokens only (parallel/cp.py)
        data = BatchSource(
            sources_of(cfg.data),
            seed=cfg.train.seed,
            global_batch=cfg.train.global_batch,
            seq_len=cfg.train.seq_len,
            dp_rank=dims.dp_rank(self.mesh),
            dp=dims.dp,
            seq_positions=positions,
            sample_overlap=cfg.data.sample_overlap,
        )
        heldout = HeldoutEval(
            cfg, dp_rank=dims.dp_rank(self.mesh), dp=dims.dp, loss_fn=cross_entropy, seq_positions=positions
        )
        return data, heldout

    def _build_model(self, cfg: JobConfig, derived: Derived) -> None:
        """This rank's model parts built on meta, parallelized (the recipe of parallel/), materialised and
        initialised, and, with pipeline parallelism, the schedule over its stages."""
        dims = derived.dims
        with torch.device("meta"):
            model = Transformer(cfg.model)
        self.parts, self.stages = parallelize(
            model,
            dims=dims,
            mesh=self.mesh,
            stages_per_rank=derived.stages_per_rank,
            pp_schedule=cfg.mesh.pp_schedule,
            sequence_parallel=cfg.mesh.sequence_parallel,
            loss_parallel=cfg.mesh.loss_parallel,
            activation_checkpointing=cfg.train.activation_checkpointing,
            ac_every=cfg.train.ac_every,
            pp_layers_per_stage=derived.pp_layers_per_stage,
            compile=cfg.train.compile,
            compile_backend=cfg.train.compile_backend,
            mixed_precision=self.mixed_precision,
            ep_mesh=self.ep_mesh,
            cp_impl=cfg.mesh.cp_impl,
            seq_len=cfg.train.seq_len,
        )
        for part in self.parts:
            part.to_empty(device=self.device)
            init_weights(part, seed=cfg.train.seed)
            part.train()
        self._sent = torch.zeros((), dtype=torch.float64, device=self.device)  # `_record_sent`
        self.has_first = 0 in self.stages
        self.has_last = (derived.num_stages - 1) in self.stages
        self.schedule = None
        if dims.pp_enabled:
            self.schedule = build_schedule(
                self.parts,
                self.stages,
                num_stages=derived.num_stages,
                schedule=cfg.mesh.pp_schedule,
                n_microbatches=derived.microbatches,
                pp_group=self.pp_group,
                device=self.device,
                loss_fn=cross_entropy,
            )
            # What each stage sends on (its output's sum of squares, float64, summed over microbatches; one
            # reduction per microbatch): off the last stage the loss is 0, so the SDC re-run compares this.
            for part, stage in zip(self.parts, self.stages):
                if stage != derived.num_stages - 1:
                    part.register_forward_hook(self._record_sent)

    def _build_observers(self, cfg: JobConfig, env: DistEnv, events: EventLog) -> None:
        """Per-rank phase timing and stragglers (jobs/telemetry), and TensorBoard on rank 0 when asked for."""
        dims = self.derived.dims
        self.telemetry = build_step_telemetry(
            cfg,
            env,
            events=events,
            pp=dims.pp_enabled,
            mesh=dims.describe(),
            device=self.device,
            mixed_precision=self.mixed_precision,
            pp_rank=self.mesh["pp"].get_local_rank() if dims.pp_enabled else 0,
        )
        self.timer = self.telemetry.timer  # `with self.timer.phase(name):` around each part of a step
        self.tensorboard = None
        if cfg.metrics.tensorboard and env.rank == 0:
            from jobs.telemetry.tensorboard import ScalarLog

            self.tensorboard = ScalarLog(cfg.run.dir)

    def _loss_ctx(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.use_loss_parallel else contextlib.nullcontext()

    @torch.no_grad()
    def _record_sent(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._sent += _local(output).detach().double().pow(2).sum()

    def _forward_value(self, local_loss: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step's forward for the SDC re-run: its loss, plus under pipeline parallelism
        what its stages sent on (off the last stage the loss is 0)."""
        return local_loss if self.schedule is None else local_loss.detach().double() + self._sent

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Runs this dp rank's batch through forward and backward; returns its mean loss (0 off the last stage)."""
        n_micro = self.derived.microbatches
        if self.schedule is not None:
            self._sent.zero_()
            losses: list[torch.Tensor] | None = [] if self.has_last else None
            args = (inputs,) if self.has_first else ()
            with self._loss_ctx(), self.timer.phase("pp_step"):
                self.schedule.step(
                    *args, target=targets if self.has_last else None, losses=losses, return_outputs=False
                )
            if not self.has_last:
                return torch.zeros((), device=self.device)
            return torch.stack([_whole(l) for l in losses]).mean()
        (model,) = self.parts
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):
            if self.derived.dims.fsdp_enabled:
                model.set_requires_gradient_sync(i == n_micro - 1)
            with self._loss_ctx():
                with self.timer.phase("forward"):
                    loss = cross_entropy(model(x), y)
                with self.timer.phase("backward"):
                    (loss / n_micro).backward()
            total += _whole(loss).detach()
        return total / n_micro

    def reduce_totals(self, local_loss: torch.Tensor, *, interval_end: bool = False) -> tuple[float, float, bool]:
        """The step's one world all-reduce: (global grad norm, global loss, stop agreed).

        A stage's squared grad norm is held alike by its world/pp ranks, only the last stage holds a
        loss (alike on each dp slice's tp ranks), and any rank's stop flag stops every rank after
        this same step. At a log interval's last step every rank's phase times ride along (stragglers).
        """
        stop = 1.0 if self.resilience.stop_requested else 0.0
        totals = torch.stack(
            [
                stage_grad_sq_norm(self.parts, self.device),
                local_loss.detach().double().reshape(()),
                torch.tensor(stop, dtype=torch.float64, device=self.device),
            ]
        )
        phases = self.telemetry.outgoing(interval_end=interval_end)
        if phases is not None:
            totals = torch.cat([totals, torch.as_tensor(phases, dtype=torch.float64, device=self.device)])
        with self.timer.phase("collective"):
            dist.all_reduce(totals)
        if phases is not None:
            self.telemetry.incoming(totals[3:].cpu().numpy())
            totals = totals[:3]
        stop_agreed = bool(totals[2] > 0)
        totals /= self.env.world_size // self.derived.dims.pp
        return math.sqrt(float(totals[0])), float(totals[1]), stop_agreed

    def optimizer_step(self) -> float:
        """AdamW and the LR schedule on every model part, then the MoE routers' bias update; returns the learning
        rate the step used.
        A checkpoint save may still be copying these parameters: each opt.step() first waits for that
        copy (a step pre-hook that CheckpointManager.load_latest put on every optimizer)."""
        lr = self.lr_schedulers[0].get_last_lr()[0]
        for opt, sched in zip(self.optimizers, self.lr_schedulers):
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        self.moe_balance = update_expert_bias(self.moe_layers, rate=self.cfg.model.moe_bias_rate, group=self.moe_group)
        return lr

    def _moe_group(self):
        """The ranks whose router counts add up to the global batch's for this rank's MoE layers: the world,
        or with pp the ranks of this stage (jobs.models.moe.update_expert_bias); None for one process or a dense model.

        Every rank of an MoE model builds the stage group, a dense-only stage too (DeepSeek-V3's split: the dense
        blocks alone on stage 0): torch names groups by a per-process counter, so a rank that skipped it would give
        every later group (the checkpoint manager's, the RAM tier's) another name than its peers and hang in them."""
        model = self.cfg.model
        if model.n_routed_experts == 0 or model.n_dense_layers >= model.n_layers or self.env.world_size == 1:
            return None
        if not self.derived.dims.pp_enabled:
            return dist.group.WORLD
        group = self.mesh[("dp_replicate", "dp_shard", "cp", "tp")]._flatten("moe_stage").get_group()
        return group if self.moe_layers else None

    def _moe_balance_fields(self) -> dict[str, float]:
        """The last step's balance of every MoE layer as metrics fields `<BALANCE_FIELDS name>/<block>`, on every
        rank: one all-reduce of a (MoE layers, 3) table to which each rank adds its own layers' share (a stage's
        ranks hold the same loads and biases; the balance loss is averaged over the ranks and microbatches)."""
        model = self.cfg.model
        if model.n_routed_experts == 0 or model.n_dense_layers >= model.n_layers:
            return {}
        first, holders = model.n_dense_layers, self.env.world_size // self.derived.dims.pp
        table = torch.zeros(model.n_layers - first, len(BALANCE_FIELDS), dtype=torch.float64, device=self.device)
        if self.moe_balance is not None:
            share = self.moe_balance.double() / holders
            share[:, 2] /= self.derived.microbatches
            table[[i - first for i in moe_layer_ids(self.parts)]] = share
        if self.env.world_size > 1:
            dist.all_reduce(table)
        return {
            f"{name}/{first + i}": float(v)
            for i, row in enumerate(table.tolist())
            for name, v in zip(BALANCE_FIELDS, row)
        }

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        with self.memory.track(step):
            with self.timer.phase("data"):
                inputs, targets = (t.to(self.device, non_blocking=True) for t in self.resilience.batch(step))
            local_loss = self.forward_backward(inputs, targets)
            if not self.derived.dims.fsdp_enabled:
                with self.timer.phase("pp_step" if self.schedule is not None else "backward"):
                    _replicate_partial_grads(self.parts)
            self.resilience.after_backward(step)  # tests only: MESHJOB_TEST_FLIP_GRAD (a no-op unless set)
            grad_norm, loss, stop = self.reduce_totals(local_loss, interval_end=self._interval_end(step + 1))
            self.resilience.before_optimizer(  # SDC: a suspicious step is re-run first
                step,
                self.state,
                loss=loss,
                grad_norm=grad_norm,
                forward_value=self._forward_value(local_loss),
                recompute=lambda: self._forward_value(self._recompute(inputs, targets)),
            )
            with self.timer.phase("optimizer"):
                clip_grads_(self.parts, max_norm=self.cfg.optim.grad_clip, total_norm=grad_norm)
                lr = self.optimizer_step()
        dt = time.perf_counter() - t0
        peak = self.cfg.cluster.gpu_bf16_tflops if self.memory.device.type == "cuda" else None
        flops = achieved(
            flops_per_token=self.flops_per_token,
            tokens_per_step=self.derived.tokens_per_step,
            world_size=self.env.world_size,
            step_time_s=dt,
            peak_tflops=peak,
        )
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": dt,
            "tokens_per_s": self.derived.tokens_per_step / dt,
            **flops,
            "stop": stop,
        }

    def _recompute(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The step's forward and backward again, from the same state on the same batch (sdc re-run)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        local_loss = self.forward_backward(inputs, targets)
        if not self.derived.dims.fsdp_enabled:
            _replicate_partial_grads(self.parts)
        return local_loss

    def fit(self) -> str:
        """Trains to train.steps; returns "done", or "stopped" when an agreed stop signal ended the
        attempt early (after saving that step; before the first step, without a save)."""
        cfg, st = self.cfg.train, self.state
        self.resilience.phase("load")
        # Resume: the newest valid checkpoint under run.dir (sets st.step, the data cursor), else step 0;
        # then every recorded rollback's data skip and LR scale again.
        self._load()
        self.resilience.resume(st)
        if self.tensorboard is not None:  # after a restart, TensorBoard drops what this attempt trains again
            self.tensorboard.purge_step = st.step + 1
        self.events.emit(
            "train_start",
            step=st.step,
            steps=cfg.steps,
            mesh=self.derived.dims.describe(),
            world_size=self.env.world_size,
            tokens_per_step=self.derived.tokens_per_step,
            microbatches=self.derived.microbatches,
            pp_layers_per_stage=list(self.derived.pp_layers_per_stage),
            device=str(self.device),
            mixed_precision=self.mixed_precision,
        )
        if self.resilience.stop_before_training(st.step):  # a signal during start-up: nothing new to save
            return "stopped"
        self.resilience.phase("train")
        step_times: list[float] = []
        while st.step < cfg.steps:
            m = self.train_step(st.step)
            verdict = self.resilience.after_step(st, m, stop=m.pop("stop"), last=st.step + 1 >= cfg.steps)
            if verdict.rolled_back:
                self.telemetry.timer.drop_step()
                continue  # a loss spike: rolled back to an earlier checkpoint (st.step is its step now)
            st.record(step=st.step + 1, loss=m["loss"], tokens=self.derived.tokens_per_step)
            self._after_step(st.step, m, step_times)
            if not verdict.stop and self.ckpt.memory_due(st.step):  # the RAM tier (checkpoint/memory_tier.py)
                self._save(st.step, tier="memory")
            if self.ckpt.due(st.step, step_time_s=m["step_time_s"]) or (verdict.stop and self.cfg.checkpoint.enabled):
                self._save(st.step)
            self.telemetry.step_done(st.step, interval_end=self._interval_end(st.step))
            if verdict.stop:
                self._wait_for_saves()  # committed before the job lets go of its nodes
                self.ckpt.drop_memory()  # the stop step is on the filesystem: the RAM copies go with the nodes
                self.resilience.stopped(st.step)
                return "stopped"
        self._wait_for_saves()  # the last save is committed (or its failure raised) before the run counts as done
        self.ckpt.drop_memory()
        self.events.emit("train_end", step=st.step, tokens_seen=st.tokens_seen)
        self.telemetry.finish(
            healthy=self.env.rank == 0 and healthy_run(self.events.path),
            about={"run_dir": self.cfg.run.dir, "steps": st.step},
        )
        return "done"

    def _interval_end(self, step: int) -> bool:
        """Whether step `step` (numbered from 1) ends a log interval."""
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps

    def _load(self, before_step: int | None = None) -> int:
        """The newest valid checkpoint (of a step < before_step) into the model, optimizers, schedulers and state;
        the sampler goes on from its data cursor (ValueError when a data file changed, data.accept_changed_files)."""
        step = self.ckpt.load_latest(
            model_parts=self.parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            train_state=self.state,
            before_step=before_step,
            rollbacks=self.resilience.known_rollbacks(),  # a RAM step of an abandoned timeline is never loaded
        )
        for note in self.data.restore(
            self.state.data, step=step, accept_changed_files=self.cfg.data.accept_changed_files
        ):
            if self.env.rank == 0:
                self.log.warning("resuming at step %d: %s", step, note)
                self.events.emit("data_cursor_changed", step=step, note=note)
        return step

    def _agree(self, obj: object) -> object:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        if dist.is_initialized() and self.env.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _after_step(self, step: int, m: dict[str, float], step_times: list[float]) -> None:
        """Progress for the watchdog, the shorter collective timeout after the first step, metrics."""
        self.resilience.progress(step, first=not step_times)
        if not step_times:
            self.events.emit("first_step", step=step, step_time_s=m["step_time_s"])
        step_times.append(m["step_time_s"])
        self.trained_steps.append([step, round(time.time(), 4), round(m["step_time_s"], 6)])
        if self._interval_end(step):
            self._log_metrics(step, m, step_times)
        if self.heldout.due(step):  # train.eval_every: held-out loss on this mesh (jobs/evaluate.py)
            self.heldout.run(self, step)

    def _save(self, step: int, *, tier: str = "filesystem") -> None:
        # A save first waits for the one in flight, then writes (async_mode=none) or stages: a checkpoint
        # phase, bounded by failure.checkpoint_timeout_s rather than the hang timeout. The RAM tier's save
        # hands its state to a thread of its own (checkpoint/memory_tier.py), like an async filesystem save.
        self.resilience.phase("checkpoint_save")
        self.state.data = self.data.cursor(self.resilience.data_step(step))  # the next data step to read, and where
        with self.timer.phase("checkpoint"):  # the blocking part of the save (async saves go on after it)
            if tier == "memory":
                self.ckpt.save_memory(step)
            else:
                self.ckpt.save(step)
        self.resilience.phase("train")

    def _wait_for_saves(self) -> None:
        """Until the save in flight is committed (end of training, the stop path): a final write may take
        longer than failure.hang_timeout_s, so the watchdog bounds it by failure.checkpoint_timeout_s."""
        self.resilience.phase("checkpoint_wait")
        self.ckpt.wait()

    def _log_metrics(self, step: int, m: dict[str, float], step_times: list[float]) -> None:
        m = {**m, **self.memory.read(), **self._moe_balance_fields()}  # every rank ends its memory window
        trained, self.trained_steps = self.trained_steps, []
        if self.env.rank != 0:
            return
        if trained:  # throughput and MFU as the interval's averages (total tokens / total time), not the last step's
            scale = m["step_time_s"] * len(trained) / max(sum(dt for _, _, dt in trained), 1e-12)
            m.update({k: m[k] * scale for k in ("tokens_per_s", "tflops_per_rank", "mfu") if k in m})
        recent = sorted(step_times[-10:])[len(step_times[-10:]) // 2]
        eta = recent * (self.cfg.train.steps - step)
        record = {
            "step": step,
            **m,
            "eta_s": eta,
            "restart": self.env.restart_count,
            "attempt": self.env.attempt,
            "time": time.time(),
            "trained_steps": trained,
        }
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        self.log.info(
            "step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s | %.3f s/step | %s | ETA %s",
            step,
            self.cfg.train.steps,
            m["loss"],
            m["lr"],
            m["grad_norm"],
            m["tokens_per_s"],
            m["step_time_s"],
            _fmt_efficiency(m),
            _fmt_eta(eta),
        )

    def close(self) -> None:
        try:
            self.timer.flush()  # rows since the last log interval (a stopped attempt)
            self.ckpt.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
        finally:
            self.data.close()
            self.heldout.close()


def build_checkpoint_manager(cfg: JobConfig, derived: Derived, env: DistEnv, *, events: EventLog) -> CheckpointManager:
    """The run's CheckpointManager; the job MTBF for interval=auto also counts the failures in events.jsonl."""
    failures, observed_s = failures_in_ledger(read_events(events.path))
    mtbf_s = job_mtbf_s(
        mtbf_job_hours=cfg.failure.mtbf_job_hours,
        mtbf_node_hours=cfg.failure.mtbf_node_hours,
        nodes=env.nodes,
        failures_seen=failures,
        observed_s=observed_s,
    )
    return CheckpointManager(
        Path(cfg.run.dir) / "checkpoints",
        cfg=cfg.checkpoint,
        rank=env.rank,
        world_size=env.world_size,
        emit=events.emit,
        manifest_extra={"mesh": derived.dims.describe(), "config_hash": config_hash(cfg)},
        total_steps=cfg.train.steps,
        mtbf_s=mtbf_s,
        attempt=env.attempt,
        checkpoint_timeout_s=cfg.failure.checkpoint_timeout_s,
        run_id=run_id(cfg.run.dir),
        # the RAM tier's node: Slurm's node name; the local launcher runs launcher.nodes simulated nodes on one
        # host, told apart by their node rank (so "a node lost" = that node's folder of the tier removed)
        node=env.hostname if env.job_id is not None else f"{env.hostname}.node{env.node_rank}",
        tier_shares=_tier_shares(cfg),
        # under Slurm, partner copies go to another physical host (or leaf switch) where the nodes allow
        domain=failure_domain(env.hostname, topology=topology_path()) if env.job_id is not None else "",
    )


def _tier_shares(cfg: JobConfig) -> dict[str, float]:
    """{checkpoint tier: share of all failures it is read after} (checkpoint/tiers.py), the same rule as jobs.plan's."""
    spares = getattr(cfg.launcher, "spare_nodes", 0)
    memory, partner = tiers_on(cfg.checkpoint, spare_nodes=spares, nodes=cfg.launcher.nodes)
    return tier_shares(
        process_share=cfg.failure.process_share,
        node_share=cfg.failure.node_share,
        memory=memory,
        partner=partner,
        spare_nodes=spares,  # finite per allocation: the node failures past them are read from the filesystem
    )


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _param_device(parts: list[nn.Module]) -> torch.device:
    """Where this rank's parameters live (a DTensor reports its local device)."""
    return next(p.device for part in parts for p in part.parameters())


def _fmt_efficiency(m: dict) -> str:
    """TFLOP/s per rank, MFU on a GPU, and the window's peak memory when it was measured."""
    out = f"{m['tflops_per_rank']:.3g} TFLOP/s/rank"
    if "mfu" in m:
        out += f" | {mfu_text(m['mfu'])}"
    if "peak_mem_bytes" in m:
        out += f" | peak mem {m['peak_mem_bytes'] / 2**20:.1f} MiB"
    return out


def _fmt_eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
