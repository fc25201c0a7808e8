"""Sequence-parallel cases run in ``torch.multiprocessing`` workers by tests/models/test_ulysses.py.

Spawned processes import this module by name (tests/ is on sys.path), so everything they run
lives here. Every rank builds the same float64 tiny model and the same packed micro-batch of
ragged rows, scores it once in one process (the packed path, no group) and once with its
slice under sequence parallelism; rank 0 returns both, and the test compares them.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from builders import ragged_rollouts
from torch import Tensor, nn

import rlblocks as rb
from rlblocks.models import ulysses
from rlblocks.models.packing import Packed, packed_attention
from rlblocks.trainer.packing import pack

# Per world size, models whose heads split over it in each way the attention handles: kv heads
# divisible by sp (no repeat), or not (each repeated sp / gcd(h_kv, sp) times), fewer than sp.
MODELS: dict[int, dict[str, dict]] = {
    2: {
        "h4_kv2": {"num_attention_heads": 4, "num_key_value_heads": 2},
        # 3 kv heads, each repeated twice (6 = h): catches a repeat in the wrong order.
        "h6_kv3": {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
        "h2_kv1": {},  # rb.models.tiny's own heads: 2 query heads, 1 kv head
    },
    3: {
        "h6_kv3": {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
        "h6_kv2": {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96},
    },
}


def packed_batch() -> Packed:
    """9 ragged rows packed: 65 tokens, so 2 ranks pad it to 66 and 3 ranks to 66 too, and
    rows cross every slice boundary (rows [30, 37) at 33; [18, 30) at 22, [37, 46) at 44)."""
    return pack(ragged_rollouts(9, seed=0))


def token_logprobs(logits: Tensor, index: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits[0, index])[targets], ``(m)`` float64."""
    return torch.log_softmax(logits[0, index], dim=-1).gather(-1, targets[:, None])[:, 0]


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def summed_over_ranks(values: dict[str, Tensor]) -> dict[str, Tensor]:
    for value in values.values():
        dist.all_reduce(value)
    return values


def one_process(overrides: dict, packed: Packed) -> dict:
    """The packed forward in this process alone: log-probs of the kept tokens, and the
    gradients of two losses (the plain sum; a mean of squares, which mixes the tokens)."""
    out = {}
    for loss_name, loss in (("sum", torch.sum), ("squares", lambda x: x.square().mean())):
        model, _ = rb.models.tiny(dtype=torch.float64, **overrides)
        with packed_attention(model, packed) as kwargs:
            logits = model(**kwargs).logits  # (1 n v)
        logprobs = token_logprobs(logits, packed.keep, packed.targets)
        loss(logprobs).backward()
        out[f"grads_{loss_name}"] = grads(model)
        out["logprobs"], out["logits"] = logprobs.detach(), logits.detach()
    return out


def sequence_parallel(overrides: dict, packed: Packed) -> dict:
    """The same under sequence parallelism over every process: each rank runs its slice.

    ``grads_sum``: each rank's loss is the sum of its own tokens' log-probs, gradients summed
    over the ranks. ``grads_squares``: every rank computes the same loss from the gathered
    log-probs (:func:`ulysses.gather_at`), gradients summed over the ranks."""
    out = {}
    for loss_name in ("sum", "squares"):
        model, _ = rb.models.tiny(dtype=torch.float64, **overrides)
        shard = ulysses.split(packed.input_ids, packed.position_ids)
        with ulysses.sequence_parallel(model, shard) as kwargs:
            logits = model(**kwargs).logits  # (1 l v)
        mine, local = shard.local(packed.keep)
        own = token_logprobs(logits, local, packed.targets[mine])
        whole = ulysses.gather_at(own, packed.keep, shard)  # (m), every rank's tokens
        loss = own.sum() if loss_name == "sum" else whole.square().mean()
        loss.backward()
        out[f"grads_{loss_name}"] = summed_over_ranks(grads(model))
        out["logprobs"] = whole.detach()
        out["logits"] = ulysses.gather(logits.detach(), shard)  # (1 n v), padding dropped
        out["local_length"] = shard.input_ids.shape[1]
    return out


def equal_to_one_process(rank: int) -> dict:
    packed = packed_batch()
    models = MODELS[dist.get_world_size()]
    return {
        name: {"one": one_process(kw, packed), "sp": sequence_parallel(kw, packed)}
        for name, kw in models.items()
    }


def refusals(rank: int) -> dict:
    """Rank 0 asks for models that cannot run, rank 1 splits over a group it is not in; then
    both run a real forward. Had a refusal sent anything, the other rank's first all-to-all
    would meet it and the forward that both then run would hang or differ from one process."""
    packed = packed_batch()
    messages = {}
    rank_0_only = dist.new_group([0])  # every rank creates every group
    if rank == 1:
        messages["group"] = _refusal(
            lambda: ulysses.split(packed.input_ids, packed.position_ids, rank_0_only)
        )
    if rank == 0:
        shard = ulysses.split(packed.input_ids, packed.position_ids)
        three_heads, _ = rb.models.tiny(num_attention_heads=3, hidden_size=96)
        checkpointed, _ = rb.models.tiny()
        checkpointed.gradient_checkpointing_enable()
        checkpointed.train()
        windowed, _ = rb.models.tiny(use_sliding_window=True, sliding_window=4, max_window_layers=0)
        for name, model in (
            ("heads", three_heads),
            ("checkpointing", checkpointed),
            ("window", windowed),
        ):
            messages[name] = _refusal(
                lambda m=model: ulysses.sequence_parallel(m, shard).__enter__()
            )
        two_heads, _ = rb.models.tiny()  # under tp = 2 each rank holds one head
        messages["heads_tp"] = _refusal(
            lambda: ulysses.sequence_parallel(two_heads, shard, tp=2).__enter__()
        )
        messages["split"] = _refusal(
            lambda: ulysses.split(packed.input_ids[0], packed.position_ids[0])
        )
        messages["other_inputs"] = _refusal(lambda: _whole_sequence_inside(shard, packed))
        messages["positions"] = _refusal(
            lambda: ulysses.split(packed.input_ids[:, 1:], packed.position_ids[:, 1:])
        )
    after = sequence_parallel({}, packed)["logprobs"]
    reference = one_process({}, packed)["logprobs"]
    gathered: list = [None, None]
    dist.all_gather_object(gathered, messages)  # rank 1's refusal too
    return {"messages": gathered[0] | gathered[1], "after": after, "reference": reference}


def _whole_sequence_inside(shard: ulysses.Shard, packed: Packed) -> None:
    """The whole sequence run inside the block meant for this rank's slice: the attention
    refuses it in the first layer, before its all-to-all."""
    model, _ = rb.models.tiny(dtype=torch.float64)
    with ulysses.sequence_parallel(model, shard):
        model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)


def _refusal(call) -> str | None:
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


CASES = {"equal_to_one_process": equal_to_one_process, "refusals": refusals}


def worker(rank: int, world: int, case: str, out: str, store: str) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        result = CASES[case](rank)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # As in dp_cases.worker: done, saved and the group destroyed; skip the interpreter's teardown
    # (gloo's C++ destructors have aborted there).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(case: str, out: str, world: int = 2) -> dict:
    """Spawn ``world`` gloo processes on ``case``; rank 0's result."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(worker, args=(world, case, out, store), nprocs=world, join=True)
    return torch.load(out, weights_only=False)
