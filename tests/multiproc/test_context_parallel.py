"""Context parallelism (parallel/cp.py) on real gloo ranks: cp ranks together compute the single-process loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from jobs.config import ModelConfig
from jobs.models.model import Transformer, init_weights
from jobs.trainer import cross_entropy
from parallel.cp import apply_cp, ring_blocks
from parallel.tp import apply_tp
from tests.conftest import run_train
from tests.multiproc._ranks import run_ranks
from tests.multiproc.test_parity import COMMON, SAVES, STEPS

pytestmark = pytest.mark.multiproc

SEQ, BATCH = 32, 2
CFG = ModelConfig(
    name="cp_test", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64, max_seq_len=64
)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    toks = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return toks[:, :-1], toks[:, 1:]


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    """The single-process loss and gradients of the full batch."""
    model = Transformer(CFG)
    init_weights(model, seed=3)
    x, y = _batch()
    loss = cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_rank(rank: int, world: int, *, impl: str, cp: int, tp: int, fused: bool = True) -> dict:
    """One fwd/bwd on a (cp, tp) mesh; gradients averaged over cp here (the trainer's FSDP does it over dp_shard*cp)."""
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    with torch.device("meta"):
        model = Transformer(CFG)
    apply_cp(model, mesh["cp"], impl=impl, seq_len=SEQ)
    for block in model.layers.values():
        block.attention.context_parallel.fused = fused
    if tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=True, loss_parallel=False)
    model.to_empty(device="cpu")
    init_weights(model, seed=3)
    x, y = _batch()
    pos = model.rope_positions
    loss = cross_entropy(model(x[:, pos]), y[:, pos])
    loss.backward()
    dist.all_reduce(loss := loss.detach().clone(), group=mesh.get_group("cp"))
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=mesh.get_group("cp"))
        grads[n] = g / cp
    blocks = {}
    for block in model.layers.values():
        for kind, count in block.attention.context_parallel.blocks.items():
            blocks[kind] = blocks.get(kind, 0) + count
    return {"loss": loss.item() / cp, "grads": grads, "blocks": blocks, "cp_rank": mesh["cp"].get_local_rank()}


def _assert_matches_reference(out, *, what: str) -> None:
    ref_loss, ref_grads = _reference()
    for rank, res in out.results.items():
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), f"{what} rank {rank}"
        for name, g in ref_grads.items():
            torch.testing.assert_close(res["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{what} rank {rank} {name}")


@pytest.mark.parametrize("impl", ["allgather", "ring"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_loss_and_gradients_equal_the_single_process_run(impl: str, cp: int) -> None:
    out = run_ranks(_cp_rank, cp, impl=impl, cp=cp, tp=1, timeout=120)
    _assert_matches_reference(out, what=f"{impl} cp{cp}")
    # Every rank does the same causal work, ring or all-gather (its query chunks attend to the chunks up to their
    # own, not to the whole gathered sequence under a mask): 2 causal + 2cp-1 full blocks per layer.
    counts = {res["cp_rank"]: res["blocks"] for res in out.results.values()}
    assert all(c == {"causal": 2 * CFG.n_layers, "full": (2 * cp - 1) * CFG.n_layers} for c in counts.values()), counts
    assert all(sorted(k for _, _, _, k in ring_blocks(cp, r)).count("full") == 2 * cp - 1 for r in range(cp))


def test_the_unfused_ring_autograd_path_equals_the_single_process_run_too() -> None:
    """The ring off CPU (no fused flash kernel with a written-out backward): autograd through _RingShift."""
    out = run_ranks(_cp_rank, 2, impl="ring", cp=2, tp=1, fused=False, timeout=120)
    _assert_matches_reference(out, what="unfused ring cp2")
    assert all(res["blocks"] == {"causal": 2 * CFG.n_layers, "full": 3 * CFG.n_layers} for res in out.results.values())


@pytest.mark.parametrize("impl", ["allgather", "ring"])
def test_cp2_with_tp2_equals_the_single_process_run(impl: str) -> None:
    out = run_ranks(_cp_rank, 4, impl=impl, cp=2, tp=2, timeout=120)
    _assert_matches_reference(out, what=f"{impl} cp2 tp2")


TRAIN_MESHES = {  # name: (world, overrides); the reference is test_parity's single-process run (same steps)
    # FSDP over dp_shard*cp, the loader's zig-zag tokens, the loss mean over cp ranks; it also saves at steps 4 and
    # 8 (test_parity.SAVES: a save changes no number), and the resume test below restarts from its step_4
    "cp2_dp_shard2_ring": (4, ["mesh.pp=1", "mesh.tp=1", "mesh.cp=2", "mesh.dp_shard=2", "mesh.cp_impl=ring", *SAVES]),
    # a pipeline stage per pp rank, each attending across cp (~30 s on 2 cores)
    "pp2_cp2_allgather": (4, ["mesh.pp=2", "mesh.tp=1", "mesh.cp=2", "mesh.dp_shard=1", "mesh.cp_impl=allgather"]),
}


def _cp_run(name: str, data_path: str) -> list[str]:
    """The overrides of TRAIN_MESHES[name]'s run (a shared run: the resume test reads the ring one)."""
    world, mesh = TRAIN_MESHES[name]
    return [*COMMON, *mesh, f"data.path={data_path}", f"launcher.tasks_per_node={world}"]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n.startswith("pp") else []) for n in TRAIN_MESHES]
)
def test_jobs_train_on_a_cp_mesh_equals_the_single_process_run(
    name: str, data_path: str, tmp_path_factory, shared_run
) -> None:
    from tests.multiproc.test_parity import _reference  # (this module has a _reference of its own)

    ref, _ = _reference([], data_path, tmp_path_factory)  # (training losses, held-out losses)
    run = shared_run(_cp_run(name, data_path))
    got = run.losses()
    assert len(got) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {name} loss {a} vs single-process {b}"


@pytest.mark.slow
def test_a_cp_run_resumes_bitwise_and_reshards_onto_one_process(data_path: str, tmp_path, shared_run) -> None:
    """Step 4's checkpoint of the shared cp2*dp_shard2 ring run above (8 steps, saves at 4 and 8), resumed on the
    same mesh (bitwise: losses and final state) and on one process (cp 2 -> 1: within fp32 tolerance)."""
    import shutil

    from checkpoint.convert import convert
    from jobs.events import read_events
    from tests.conftest import assert_states_bitwise

    ref = shared_run(_cp_run("cp2_dp_shard2_ring", data_path))  # read-only: its step_4 is copied out
    saved = 4
    world, same = TRAIN_MESHES["cp2_dp_shard2_ring"]
    final = {}
    for name, mesh in (
        ("same", [*same, f"launcher.tasks_per_node={world}"]),
        ("single", ["mesh=single", "launcher.tasks_per_node=1"]),
    ):
        run_dir = tmp_path / name
        shutil.copytree(ref.run_dir / f"checkpoints/step_{saved}", run_dir / f"checkpoints/step_{saved}")
        r = run_train([*COMMON, *SAVES, *mesh, f"data.path={data_path}"], run_dir)  # (`same` names SAVES twice)
        assert r.returncode == 0, r.stderr[-3000:]
        assert [e["step"] for e in read_events(run_dir / "events.jsonl", "checkpoint_loaded")] == [saved]
        assert len(r.losses()) == STEPS - saved, r.losses()  # steps 5..8
        for step, (a, b) in enumerate(zip(r.losses(), ref.losses()[saved:]), start=saved + 1):
            if name == "same":
                assert a == b, (step, a, b)
            else:
                assert a == pytest.approx(b, rel=1e-5), (step, a, b)
        convert(run_dir / f"checkpoints/step_{STEPS}", tmp_path / f"{name}.pt")
        final[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    convert(ref.run_dir / f"checkpoints/step_{STEPS}", tmp_path / "ref.pt")
    assert_states_bitwise(final["same"], torch.load(tmp_path / "ref.pt", weights_only=False))
