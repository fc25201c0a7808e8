"""Tensor-parallel cases run on spawned gloo ranks by tests/trainer/test_tensor_parallel.py.

Each case builds the same float64 trainer as the one-process reference, with ``tp`` set, and
returns what rank 0 saw: the metrics of one ``step`` (three optimizer steps: mini-batches of
three rows, one row per micro-batch, so the ranks of a data-parallel pair, which split three
rows 2 + 1, run padding micro-batches) and the whole weights after it. Run through
``dp_cases.run("mesh_cases:<case>", ...)``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from dp_cases import LOSS, make_batch, make_trainer

import rlblocks as rb
from rlblocks.trainer import tensor_parallel

#: Two heads and two key-value heads: every size of the tiny model splits two ways.
MODEL = {"num_key_value_heads": 2}
#: Three optimizer steps (8 rows in mini-batches of 3), one row per micro-batch.
SCHEDULE = {"mini_batch_size": 3, "micro_batch_size": 1}


def make(tp: int = 1, **overrides):
    """The cases' trainer (float64, the tiny model with :data:`MODEL`), sharded when the
    process is one of a group."""
    trainer = make_trainer(model_config=MODEL, tp=tp, **{**SCHEDULE, **overrides})
    if torch.distributed.is_initialized():
        trainer.shard()
    return trainer


def update(tp: int = 1, *, trainer=None, seed: int = 1, **overrides) -> dict:
    """One ``step`` of the shared batch (``seed``): its metrics and the whole weights after."""
    trainer = trainer or make(tp, **overrides)
    ro, advantages = make_batch(seed=seed)
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in trainer.named_weights()}}


def every_aggregation(rank: int) -> dict:
    """The update at tp = 2 (a data-parallel size of W / 2) under each aggregation mode."""
    return {name: update(2, aggregation=mode) for name, mode in rb.losses.AGGREGATIONS.items()}


def row_wise_planned_column_wise(rank: int) -> dict:
    """A wrong plan: the attention's output projection split by columns, not rows."""
    trainer = make_trainer(model_config=MODEL, tp=2, **SCHEDULE)
    trainer.model.tp_plan = {
        **trainer.model.tp_plan,
        "model.layers.*.self_attn.o_proj": "colwise",
    }
    trainer.shard()
    return update(trainer=trainer)


def untied_output_layer(rank: int) -> dict:
    """A wrong split: the tied embeddings left untied (two separate vocabulary-sharded
    weights), which runs without an error."""
    tensor_parallel._tied = lambda model: False
    return update(2)


def sync_into_engine(rank: int) -> dict:
    """A tensor-parallel trainer's weights, after a step, synced bucket by bucket into an
    ``HFEngine`` of the whole model: equal to the gathered weights."""
    trainer = make(2)
    stepped = update(trainer=trainer)
    model, tokenizer = rb.models.tiny(seed=1, dtype=torch.float64, **MODEL)
    engine = rb.rollout.HFEngine(model, tokenizer)
    rb.resharder.Resharder(bucket_mb=0.01).sync(trainer, engine)
    held = engine.model.state_dict()
    return {
        "synced": all(torch.equal(held[k], v) for k, v in stepped["weights"].items()),
        "names": sorted(stepped["weights"]),
    }


def checkpoint_shapes(rank: int) -> dict:
    """Save after step 1 into ``$RLBLOCKS_CHECKPOINT_DIR/<world>-tp<tp>`` (or ``<world>-sp<sp>``;
    tp and sp from the environment: ``RLBLOCKS_TP``, ``RLBLOCKS_SP``); then step 2 straight on, by a fresh trainer of the same
    layout loading it, and by a fresh trainer loading each other checkpoint found there."""
    root = Path(os.environ["RLBLOCKS_CHECKPOINT_DIR"])
    tp, sp = int(os.environ["RLBLOCKS_TP"]), int(os.environ.get("RLBLOCKS_SP", "1"))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    own = root / (f"{world}-tp{tp}" if sp == 1 else f"{world}-sp{sp}")
    trainer = make(tp, sp=sp)
    out = {"saved": update(trainer=trainer, seed=1)}
    own.mkdir(exist_ok=True)
    trainer.save_checkpoint(own)
    out["straight"] = update(trainer=trainer, seed=2)
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        resumed = make(tp, sp=sp)
        resumed.load_checkpoint(folder)
        out[folder.name] = update(trainer=resumed, seed=2)
    return out


def tp4_on_two(rank: int) -> dict:
    make(4)  # refused: the world has two processes
    return {}


def sp2(rank: int) -> dict:
    """The update at sp = 2 (a data-parallel size of W / 2) under each aggregation mode."""
    return {name: update(sp=2, aggregation=mode) for name, mode in rb.losses.AGGREGATIONS.items()}


def sp2_tokens_interleaved(rank: int) -> dict:
    """A wrong exchange: the all-to-all's received blocks laid out token-interleaved
    ``(l s)`` instead of rank after rank ``(s l)``, which runs without an error."""
    import torch.distributed._functional_collectives as funcol
    from einops import rearrange

    from rlblocks.models import ulysses

    def interleaved(x, group, sp):
        send = rearrange(x, "b (s h) l d -> s b h l d", s=sp).contiguous()
        received = funcol.all_to_all_single(send, None, None, group)
        return rearrange(received, "s b h l d -> b h (l s) d")

    ulysses._heads_to_sequence = interleaved
    return update(sp=2)


def sp3_on_two_heads(rank: int) -> dict:
    make_trainer(sp=3, **SCHEDULE).shard()  # refused: two attention heads do not split 3 ways
    return {}


def long_prompts(sp: int = 1) -> dict:
    """Rows of long prompts and short responses, one per micro-batch: under sp = 2 the first
    rank's slice of a row holds no response token (nothing of its own to score)."""
    from builders import ragged_rollouts

    trainer = make(sp=sp) if sp > 1 else make()
    ro = ragged_rollouts(4, seed=3, max_prompt=40, max_response=3)
    advantages = torch.randn(4, generator=torch.Generator().manual_seed(3))
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in trainer.named_weights()}}


def sp2_long_prompts(rank: int) -> dict:
    return long_prompts(sp=2)


def replayed_batch(seed: int = 1):
    """The shared batch with a sampler record (sampling replay): rows alternately top-k 5 and
    top-p 0.8, at the trainer's temperature 1."""
    ro, advantages = make_batch(seed=seed)
    rules = [[1.0, 5.0, 1.0], [1.0, 0.0, 0.8]] * (len(ro) // 2)
    return ro.replace(sampler=torch.tensor(rules, dtype=torch.float64)), advantages


def replay_update(sp: int = 1) -> dict:
    """π_θ's log-probs of :func:`replayed_batch` before a ``step`` on it, the step's metrics
    and the weights after."""
    trainer = make(sp=sp)
    ro, advantages = replayed_batch()
    logprobs = trainer.logprobs(ro)
    metrics = trainer.step(ro, advantages, loss_fn=LOSS)
    weights = {k: v.clone() for k, v in trainer.named_weights()}
    return {"logprobs": logprobs, "metrics": metrics, "weights": weights}


def replay_sp2_and_tp2(rank: int) -> dict:
    """Sampling replay at sp = 2 (the update, as one process gives it) and at tp = 2 (refused
    by every rank before any collective: the vocabulary is split over the ranks)."""
    result = {"sp2": replay_update(sp=2)}
    try:
        make(2).logprobs(replayed_batch()[0])
        result["tp2"] = None
    except ValueError as error:
        result["tp2"] = str(error)
    return result
