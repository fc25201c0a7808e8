"""Data-parallel cases run in ``torch.multiprocessing`` workers by tests/trainer/test_parallel.py.

Spawned processes import this module by name (tests/ is on sys.path), so everything they run
lives here, not in the test file. Each case returns what rank 0 saw; the test compares it
with the same update in one process.
"""

from __future__ import annotations

import copy
import faulthandler
import importlib
import os
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from builders import ragged_rollouts, tiny_trainer

import rlblocks as rb
from rlblocks.rollouts import Rollouts

LOSS = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.2))


def make_trainer(dtype=torch.float64, device="cpu", **overrides):
    """The cases' trainer: the tiny model (seed 0), lr 1e-3, entropy logged, no reference;
    eager and without autocast on a GPU too unless asked (the cases compare float32 and
    float64 updates; compiled blocks and bf16 have tests of their own)."""
    settings = {"lr": 1e-3, "log_entropy": True, "compile": False, "bf16": False, **overrides}
    return tiny_trainer(dtype, device=device, **settings)


def make_batch(
    b: int = 8, nan_rows: tuple[int, ...] = (), seed: int = 1
) -> tuple[Rollouts, torch.Tensor]:
    """The shared ragged batch in groups of 4 rows, and one advantage per row (NaN in
    ``nan_rows``)."""
    ro = ragged_rollouts(b, seed=seed, group_size=4)
    advantages = torch.randn(b, generator=torch.Generator().manual_seed(seed))
    advantages[list(nan_rows)] = float("nan")
    return ro, advantages


def step_locally(trainer, minibatch, ro, advantages, rank):
    """One update on the rows of ``minibatch`` (one mini-batch): every rank gets all of them and
    the trainer takes its own share (balanced by tokens)."""
    rows = sorted(r for part in minibatch for r in part)
    return trainer.step(ro.select(rows), advantages[rows], loss_fn=LOSS)


def worker(rank: int, world: int, case: str, out: str, store: str, backend: str = "gloo") -> None:
    faulthandler.enable()  # a crash in C++ prints every thread's Python stack to stderr
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",  # no port to pick: nothing else can take it
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        result = case_named(case)(rank)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # The rank's work is done, saved and the group destroyed: leave without the interpreter's
    # teardown. A rank has aborted there (SIGABRT, no Python frame on its only thread; in
    # test_checkpoint and test_export, three times over two sessions of full runs under load):
    # C++ destructors of gloo/FSDP state at exit, after all under test had finished. A failure
    # in the case still raises above and never reaches this line.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sharded(config=None, dtype=torch.float64, **overrides):
    trainer = make_trainer(dtype, fsdp=config, **overrides)
    trainer.shard()  # the default group: every spawned process
    return trainer


# One mini-batch of three rows on two ranks: the trainer splits it 2 + 1 by tokens, so with one
# row per micro-batch rank 1 runs a zero-weight padding micro-batch to keep both ranks in step.
UNEVEN = [[0, 2, 5]]


def uneven_micro_batches(rank: int) -> dict:
    trainer = sharded(micro_batch_size=1)
    ro, advantages = make_batch()
    metrics = step_locally(trainer, UNEVEN, ro, advantages, rank)
    return {"metrics": metrics, "weights": dict(trainer.named_weights())}


def cpu_offload(rank: int) -> dict:
    trainer = sharded(rb.trainer.FSDP(cpu_offload=True))
    ro, advantages = make_batch()
    metrics = step_locally(trainer, UNEVEN, ro, advantages, rank)
    return {"metrics": metrics, "weights": dict(trainer.named_weights())}


def bf16_params(rank: int) -> dict:
    config = rb.trainer.FSDP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    trainer = sharded(config, dtype=torch.float32)
    ro, advantages = make_batch()
    metrics = step_locally(trainer, UNEVEN, ro, advantages, rank)
    return {"metrics": metrics, "weights": dict(trainer.named_weights())}


def nan_on_one_rank(rank: int) -> dict:
    import warnings

    trainer = sharded()
    before = {k: v.clone() for k, v in trainer.named_weights()}
    rows = UNEVEN[0]
    rank_1 = rows[make_batch()[0].select(rows).balanced_shares(2)[1][0]]
    ro, advantages = make_batch(nan_rows=(rank_1,))  # a row of rank 1's share only
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        metrics = step_locally(trainer, UNEVEN, ro, advantages, rank)
    unchanged = all(torch.equal(v, before[k]) for k, v in trainer.named_weights())
    return {"metrics": metrics, "unchanged": unchanged, "rank": rank}


# Two epochs of two shuffled mini-batches of 4 rows, one row per micro-batch: with 3 ranks a
# mini-batch splits 2 + 1 + 1, so ranks run padding micro-batches too.
SCHEDULE = {"mini_batch_size": 4, "epochs": 2, "micro_batch_size": 1}


def every_aggregation(rank: int) -> dict:
    """The same update under each of the four aggregation modes."""
    out = {}
    ro, advantages = make_batch()
    for name, mode in rb.losses.AGGREGATIONS.items():
        trainer = sharded(aggregation=mode, **SCHEDULE)
        metrics = trainer.step(ro, advantages, loss_fn=LOSS)
        out[name] = {"metrics": metrics, "weights": dict(trainer.named_weights())}
    return out


def fsdp_world_one(rank: int, device: str = "cpu") -> dict:
    """FSDP2 over a group of one (``fsdp`` set explicitly): really sharded (DTensor parameters),
    one step, then a checkpoint round trip that must repeat the next step exactly."""
    from torch.distributed.tensor import DTensor

    trainer = make_trainer(
        device=device, fsdp=rb.trainer.FSDP(), mini_batch_size=4, micro_batch_size=2
    )
    trainer.shard()
    ro, advantages = make_batch()
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    weights = {k: v.cpu() for k, v in trainer.named_weights()}
    saved = copy.deepcopy(trainer.state_dict())  # state_dict holds references
    again = trainer.step(ro, advantages, loss_fn=LOSS)
    trainer.load_state_dict(saved)
    repeated = trainer.step(ro, advantages, loss_fn=LOSS)
    return {
        "metrics": metrics,
        "weights": weights,
        "sharded": trainer.dp.sharded
        and all(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "device": str(next(trainer.model.parameters()).device),
        "resumed": repeated["grad_norm"] == again["grad_norm"]
        and repeated["loss"] == again["loss"],
    }


def fsdp_world_one_cuda(rank: int) -> dict:
    return fsdp_world_one(rank, device="cuda")


def bf16_world_one_cuda(rank: int) -> dict:
    config = rb.trainer.FSDP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    trainer = make_trainer(torch.float32, device="cuda", fsdp=config)
    trainer.shard()
    ro, advantages = make_batch()
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    return {"metrics": metrics, "weights": {k: v.cpu() for k, v in trainer.named_weights()}}


def export_sharded(rank: int) -> dict:
    """``save_pretrained`` on every rank of an FSDP2 pair, each with a folder of its own under
    ``$RLBLOCKS_EXPORT_DIR`` (only rank 0's may appear): before a step, then after one."""
    from safetensors.torch import load_file

    base = Path(os.environ["RLBLOCKS_EXPORT_DIR"])
    trainer = sharded(dtype=torch.float32)
    trainer.tokenizer = rb.models.tiny_tokenizer()
    initial = dict(trainer.named_weights())  # gathered: whole tensors on every rank
    initial = {k: v.clone() for k, v in initial.items()}
    trainer.save_pretrained(base / f"initial-{rank}")
    ro, advantages = make_batch()
    step_locally(trainer, UNEVEN, ro, advantages, rank)
    weights = {k: v.clone() for k, v in trainer.named_weights()}
    returned = trainer.save_pretrained(base / f"trained-{rank}")
    if rank != 0:
        return {}
    saved = load_file(returned / "model.safetensors")
    return {
        "returned": str(returned),
        "trained_exact": set(saved) == set(weights) - {"lm_head.weight"}
        and all(torch.equal(saved[k], weights[k]) for k in saved),
        "trained_differs": any(not torch.equal(saved[k], initial[k]) for k in saved),
    }


def strict_sync_sharded(rank: int) -> dict:
    """tests/resharder/test_strict_sync.py: the check before a sync on an FSDP2 pair."""
    trainer = sharded(dtype=torch.float32)
    spec = trainer.weight_spec()  # from the DTensors, nothing gathered
    sent = {k: rb.interfaces.TensorSpec.of(v) for k, v in trainer.named_weights()}
    tokenizer = rb.models.tiny_tokenizer()
    wrong = rb.rollout.HFEngine(rb.models.tiny(seed=1, num_hidden_layers=3)[0], tokenizer)
    before = {k: v.clone() for k, v in wrong.model.state_dict().items()}
    try:
        rb.resharder.Resharder().sync(trainer, wrong)
        error = ""
    except ValueError as e:
        error = str(e)
    right = rb.rollout.HFEngine(rb.models.tiny(seed=1)[0], tokenizer)
    rb.resharder.Resharder(bucket_mb=0.01).sync(trainer, right)  # gathers bucket by bucket
    held = right.model.state_dict()
    return {
        "spec_is_gathered": list(spec.items()) == list(sent.items()),
        "error": error,
        "untouched": all(torch.equal(before[k], v) for k, v in wrong.model.state_dict().items()),
        "synced": all(torch.equal(held[k], v) for k, v in trainer.named_weights()),
    }


# ---------------------------------------------------------------------- checkpoints
# tests/trainer/test_checkpoint_resharding.py: a trainer checkpointed after one step, the next
# step taken straight on (the uninterrupted run) and again by a fresh trainer of the same kind
# that loads the checkpoint. float32, KL to the reference (its fingerprint is checked on load).
CHECKPOINTED = {"reference": "copy", **SCHEDULE}
KL_LOSS = rb.losses.kl_regularized(LOSS, kl_coef=0.1)


def make_critic(**overrides):
    model, _ = rb.models.tiny(seed=0)
    return rb.critic.CriticTrainer(model, lr=1e-3, **{**SCHEDULE, **overrides})


def train(trainer, step: int) -> dict:
    """Step ``step`` of a policy or critic on its own batch; metrics and the whole weights."""
    ro, advantages = make_batch(seed=step)
    if isinstance(trainer, rb.critic.CriticTrainer):
        metrics = trainer.step(ro, advantages)
    else:
        metrics = trainer.step(ro, advantages, loss_fn=KL_LOSS)
    weights = {k: v.detach().clone() for k, v in gathered_weights(trainer)}
    return {"metrics": metrics, "weights": weights}


def gathered_weights(trainer):
    if isinstance(trainer, rb.critic.CriticTrainer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)
        return get_model_state_dict(trainer.model, options=options).items()
    return trainer.named_weights()


def checkpoint_round_trip(make, rank: int) -> dict:
    """Save after step 1 into ``$RLBLOCKS_CHECKPOINT_DIR/saved``; step 2 straight on and by a
    fresh trainer loading it; a checkpoint from one process in ``.../single`` (if there) loaded
    by another fresh trainer for step 2. Each: metrics and whole weights (rank 0's view)."""
    root = Path(os.environ["RLBLOCKS_CHECKPOINT_DIR"])
    trainer = make()
    out = {"saved": train(trainer, 1)}
    (root / "saved").mkdir(exist_ok=True)
    trainer.save_checkpoint(root / "saved")
    out["straight"] = train(trainer, 2)
    resumed = make()
    resumed.load_checkpoint(root / "saved")
    out["resumed"] = train(resumed, 2)
    if (root / "single").is_dir():
        from_one = make()
        from_one.load_checkpoint(root / "single")
        out["from_one"] = train(from_one, 2)
    return out


def sharded_critic():
    critic = make_critic()
    critic.shard()
    return critic


def policy_checkpoint(rank: int) -> dict:
    return checkpoint_round_trip(partial(sharded, dtype=torch.float32, **CHECKPOINTED), rank)


def critic_checkpoint(rank: int) -> dict:
    return checkpoint_round_trip(sharded_critic, rank)


def lora_config():
    """The LoRA of the sharded-LoRA case: every attention projection, r 4."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def lora_sharded(rank: int) -> dict:
    """A LoRA policy sharded over the world: two epochs of two mini-batches (SCHEDULE), then
    what a resharder sends (the merged weights) and the adapters' own tensors, whole."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)  # peft draws the adapters' A from the global generator
    trainer = sharded(lora=lora_config(), **SCHEDULE)
    ro, advantages = make_batch()
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    weights = dict(trainer.named_weights())
    adapters = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    folder = Path(os.environ["RLBLOCKS_CHECKPOINT_DIR"]) / f"adapter-{rank}"
    trainer.save_adapter(folder)  # every rank gathers, and writes its own folder
    from safetensors.torch import load_file

    saved = load_file(folder / "adapter_model.safetensors")
    return {"metrics": metrics, "weights": weights, "adapters": adapters, "saved": saved}


CASES = {
    "export_sharded": export_sharded,
    "fsdp_world_one": fsdp_world_one,
    "fsdp_world_one_cuda": fsdp_world_one_cuda,
    "bf16_world_one_cuda": bf16_world_one_cuda,
    "every_aggregation": every_aggregation,
    "uneven_micro_batches": uneven_micro_batches,
    "cpu_offload": cpu_offload,
    "bf16_params": bf16_params,
    "nan_on_one_rank": nan_on_one_rank,
    "policy_checkpoint": policy_checkpoint,
    "critic_checkpoint": critic_checkpoint,
    "strict_sync_sharded": strict_sync_sharded,
    "lora_sharded": lora_sharded,
}


def case_named(case: str):
    """``CASES[case]``, or ``module:function`` of another cases module (tests/mesh_cases.py)."""
    if ":" not in case:
        return CASES[case]
    module, name = case.split(":")
    return getattr(importlib.import_module(module), name)


def run(case: str, out: str, world: int = 2, backend: str = "gloo") -> dict:
    """Spawn ``world`` processes on ``case`` (``backend`` "nccl": one GPU each); rank 0's
    result."""
    import tempfile

    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:  # the rendezvous file, outside the test's
        store = os.path.join(folder, "store")
        mp.spawn(worker, args=(world, case, out, store, backend), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def compiled_sharded(rank: int) -> dict:
    """FSDP2 over the world with every decoder block compiled: SCHEDULE's four updates."""
    trainer = sharded(compile=True, **SCHEDULE)
    ro, advantages = make_batch()
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    return {"metrics": metrics, "weights": dict(trainer.named_weights())}


CASES["compiled_sharded"] = compiled_sharded
