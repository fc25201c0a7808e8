"""A trainer's part of a run checkpoint: what ``save_checkpoint(folder)`` writes and reads back.

The folder holds (every file data, none unpickled: `rlblocks.base.statefile`):

- ``model/``: the policy in the Hugging Face format (``PolicyTrainer.save_pretrained`` with
  ``merge_lora=False``: the full model, or the LoRA adapter), loadable by transformers and vLLM
  as it is. The critic's value model has no such format: it goes into ``state/`` with the
  optimizer.
- ``state/``: the optimizer's tensors (and the critic's model) through
  ``torch.distributed.checkpoint`` (DCP) with its Hugging Face safetensors storage: every rank
  writes its own shard file (``shard-0000{rank+1}-model-00001-of-00001.safetensors``), each
  tensor keyed by its path (``optimizer/state/<parameter>/exp_avg``) with its offsets in the
  file's header, and DCP reads them back into any sharding, so a run saved on 2 workers resumes
  on 1 or 4. DCP's default storage would also write a ``.metadata`` file that it reads back
  with pickle: this storage reads its metadata from the safetensors headers instead.
  ``layout.json`` beside the shards holds the rest of the optimizer's state dict (its
  ``param_groups``, any value that is not a tensor) with each tensor's key. An optimizer that
  has taken no step (the checkpoint of step 0) has no state and none is written: reading the
  state of an empty optimizer would run a zero step on it (``get_optimizer_state_dict``) and
  change the bias correction of the first real one.
- ``trainer.json`` (rank 0): scheduler, counters, the world size, and the reference's
  fingerprint.
- ``rng-{rank}.json`` and ``.safetensors``: the random state of each rank's process
  (`rlblocks.base.rng`).

**The reference's identity.** A resumed run must keep the *initial* policy as its reference,
not the checkpointed one. The reference is frozen and rebuilt by the user's code, so instead of
saving it again the checkpoint keeps a fingerprint (per tensor: shape and the float64 sums of
the values and of their squares) and loading refuses a reference whose fingerprint differs.
The sums are computed over each rank's shard and added up, so they do not depend on the
sharding beyond float64 rounding; they are compared with a relative tolerance of 1e-6, far above
that rounding (≈ n·2⁻⁵³ ≤ 1e-8 for n ≤ 10⁸ values) and far below what two different models
differ by.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from rlblocks.base.rng import rng_state, set_rng_state
from rlblocks.base.statefile import (
    decode,
    encode,
    read_state,
    read_tree,
    tensor_keys,
    write_state,
    write_tree,
)
from rlblocks.trainer.config import apply_config
from rlblocks.trainer.export import tied_names

COUNTERS = ("steps", "optimizer_steps", "skipped_steps")
#: Beside the shards in ``state/``: the optimizer's state dict without its tensors.
LAYOUT = "layout.json"


def save_trainer(
    trainer: Any, folder: str | Path, *, model_state: bool, frozen: Iterable[tuple[str, Tensor]]
) -> None:
    """Write ``trainer``'s part (module docstring) into ``folder``; every rank calls it.
    ``model_state``: the model goes into ``state/`` with the optimizer (the critic) instead of
    the Hugging Face folder the policy writes itself before calling this. ``frozen``: the
    tensors the reference log-probs come from (none for a critic), fingerprinted."""
    folder = Path(folder)
    state = {}
    if trainer.optimizer.state:  # an optimizer that took no step has none (module docstring)
        state["optimizer"] = _optimizer_state(trainer)
    if model_state:
        state["model"] = _model_state(trainer)
    tree, tensors = encode(state)
    (folder / "state").mkdir(parents=True, exist_ok=True)
    if tensors:
        _write_shards(trainer, tensors, folder / "state")
    reference = fingerprint(frozen, trainer.dp)  # a collective: every rank, not just rank 0
    if trainer.dp.process == 0:
        write_tree(folder / "state" / LAYOUT, tree)
        meta = {
            "scheduler": trainer.scheduler.state_dict(),
            "counters": {k: getattr(trainer, k) for k in COUNTERS},
            "world_size": dist.get_world_size(trainer.dp.everyone) if trainer.dp.sharded else 1,
            "reference": reference,
        }
        write_state(folder / "trainer.json", meta)
    write_state(folder / f"rng-{trainer.dp.process}.json", rng_state())


def load_trainer(
    trainer: Any, folder: str | Path, *, model_state: bool, frozen: Iterable[tuple[str, Tensor]]
) -> None:
    """Read back what `save_trainer` wrote (the policy's model is read by the caller first).
    Checks ``frozen``'s fingerprint against the saved one; restores this rank's random state
    when the saved run had this rank."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = Path(folder)
    meta = read_state(_state_file(trainer, folder, "trainer"))
    check_reference(meta["reference"], fingerprint(frozen, trainer.dp), folder)
    tree = read_tree(folder / "state" / LAYOUT)
    saved = tensor_keys(tree)
    target: dict[str, Any] = {}
    if "optimizer" in tree:
        target["optimizer"] = _optimizer_state(trainer)
    else:  # saved before the first step: a fresh optimizer, as the saved run had
        trainer.rebuild_optimizer()
    if model_state:
        target["model"] = _model_state(trainer)
    _, tensors = encode(target)
    if set(tensors) != saved:
        raise ValueError(
            f"{type(trainer).__name__}.load_checkpoint: {folder / 'state'} holds the tensors "
            f"{_few(saved - set(tensors))} that this trainer lacks and lacks "
            f"{_few(set(tensors) - saved)}; build the trainer with the model of the saved run"
        )
    if tensors:
        _read_shards(trainer, tensors, folder / "state")
    state = decode(tree, tensors, where=str(folder / "state" / LAYOUT))
    with _quiet():
        if model_state:
            set_model_state_dict(trainer.model, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"])
    trainer.scheduler.load_state_dict(meta["scheduler"])
    apply_config(trainer.optimizer, trainer.scheduler, trainer.config)  # the asked lr, schedule
    for name, value in meta["counters"].items():
        setattr(trainer, name, int(value))
    rng = folder / f"rng-{trainer.dp.process}.json"
    if rng.is_file():  # a rank the saved run did not have starts with its own random state
        set_rng_state(read_state(rng))


def _state_file(trainer: Any, folder: Path, name: str) -> Path:
    """``folder/name.json``; an older checkpoint's pickled ``name.pt`` in its place is refused
    by name (it is never unpickled)."""
    path = folder / f"{name}.json"
    if not path.is_file() and (folder / f"{name}.pt").is_file():
        raise ValueError(
            f"{type(trainer).__name__}.load_checkpoint: {folder / name}.pt is a checkpoint of an "
            "older rlblocks, a pickle that rlblocks no longer unpickles (it could run code); "
            "start the run again, or resume it with the rlblocks version that wrote it"
        )
    return path


def _write_shards(trainer: Any, tensors: dict[str, Tensor], folder: Path) -> None:
    """Each rank's tensors (whole, or its DTensor shards) into its shard file (module
    docstring). DCP reports a failed write (a full disk, a file size limit) as a
    ``CheckpointException``, a ``BaseException``: raised again as an ``OSError`` naming the
    file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(str(folder), save_distributed=True)
    try:
        with _quiet():
            dcp.save(tensors, storage_writer=writer, process_group=_group(trainer))
    except CheckpointException as err:
        raise OSError(
            f"{type(trainer).__name__}.save_checkpoint: could not write "
            f"{_shard_files(folder, err)}: {_cause(err)}; free space (or raise the file size "
            "limit) and save again"
        ) from err


def _read_shards(trainer: Any, tensors: dict[str, Tensor], folder: Path) -> None:
    """Fill ``tensors`` (this rank's, in its current sharding) from the shard files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    try:
        with _quiet():
            dcp.load(
                tensors,
                storage_reader=HuggingFaceStorageReader(str(folder)),
                process_group=_group(trainer),
            )
    except CheckpointException as err:
        raise ValueError(
            f"{type(trainer).__name__}.load_checkpoint: could not read the shards "
            f"{_few(p.name for p in folder.glob('*.safetensors'))} in {folder}: {_cause(err)}; "
            "the checkpoint is damaged: resume from another one"
        ) from err


def _shard_files(folder: Path, err: BaseException) -> str:
    """The shard files of the ranks that failed (by DCP's naming, ``shard-0000{rank+1}-*``)."""
    ranks = sorted(getattr(err, "failures", {}) or {0: None})
    names = [f"shard-{rank + 1:05d}-*.safetensors" for rank in ranks]
    found = [str(p) for name in names for p in sorted(folder.glob(name))]
    return ", ".join(found) or ", ".join(str(folder / name) for name in names)


def _cause(err: BaseException) -> str:
    """The first rank's own exception inside DCP's ``CheckpointException``."""
    for wrapped in (getattr(err, "failures", None) or {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"{type(inner).__name__}: {inner}"
    return str(err)


def _few(names: Iterable[str], shown: int = 5) -> str:
    names = sorted(names)
    return str(names[:shown])[:-1] + (
        f", ... ({len(names)} in all)]" if len(names) > shown else "]"
    )


# ---------------------------------------------------------------------- the policy's weights
def save_weights(trainer: Any, folder: str | Path) -> None:
    """The policy's ``save_pretrained(folder, merge_lora=False)``: its full weights or its LoRA
    adapter, exactly. An adapter of an in-memory base model is fine here (the resumed run has
    the base): the warning that ``AutoPeftModelForCausalLM`` could not load it is left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*names no base model.*")
        trainer.save_pretrained(folder, merge_lora=False)


def load_weights(trainer: Any, folder: str | Path) -> None:
    """Load the weights ``save_pretrained(folder, merge_lora=False)`` wrote into ``trainer``'s
    model, exactly: the adapter for a LoRA policy, every tensor otherwise (a tied weight is
    saved once and restored through the tie)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"PolicyTrainer.load_checkpoint: no *.safetensors file in {folder}; pass a folder "
            "that save_checkpoint wrote"
        )
    saved: dict[str, Tensor] = {}
    for file in files:
        saved |= load_file(file)
    if trainer.has_adapter:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(trainer.model, saved)
        unexpected = list(result.unexpected_keys)  # type: ignore[attr-defined]  # peft annotates it "namedtuple"
        if unexpected:
            raise KeyError(
                f"PolicyTrainer.load_checkpoint: {folder} has adapter tensors the policy does not "
                f"have: {unexpected}; build the policy with the LoRA config of the saved run"
            )
        return
    _load_full_weights(trainer, saved, folder)


def _load_full_weights(trainer: Any, saved: Mapping[str, Tensor], folder: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = trainer.model
    names = set(model.state_dict())
    extra = sorted(set(saved) - names)
    missing = sorted(names - set(saved) - set(tied_names(model)))  # tied: saved once
    if extra or missing:
        raise KeyError(
            f"PolicyTrainer.load_checkpoint: {folder} does not fit the policy: missing {missing}, "
            f"extra {extra}; build the policy from the model of the saved run"
        )
    if trainer.dp.sharded:
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, dict(saved), options=options)
    else:
        model.load_state_dict(saved, strict=False)


# ---------------------------------------------------------------------- reference identity
def fingerprint(tensors: Iterable[tuple[str, Tensor]], dp: Any) -> dict[str, list[float]]:
    """Per tensor: its numel and the float64 sums of its values and squares, added over every
    process of the trainer, each part counted once (``dp.copies``: tensor parallelism keeps
    some tensors whole, or data-parallel shards, on several processes)."""
    names, rows = [], []
    for name, tensor in tensors:
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().double()
        names.append(name)
        row = torch.stack([local.new_tensor(local.numel()), local.sum(), local.square().sum()])
        rows.append(row / dp.copies(tensor) if dp.sharded else row)
    if not rows:
        return {}
    stacked = torch.stack(rows)
    if dp.sharded and dp.device is not None:  # NCCL reduces CUDA tensors
        stacked = stacked.to(dp.device)
    if dp.sharded:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=dp.everyone)
    total = stacked.cpu()
    return {name: row.tolist() for name, row in zip(names, total, strict=True)}


def check_reference(
    saved: Mapping[str, list[float]], now: Mapping[str, list[float]], where: Path
) -> None:
    """Raise if the reference differs from the one the checkpoint was taken with."""
    if set(saved) != set(now):
        raise ValueError(
            f"PolicyTrainer.load_checkpoint: {where} was taken with a reference of "
            f"{len(saved)} tensors, this policy's has {len(now)}; build the policy from the "
            "same initial model"
        )
    for name, (n, s, q) in saved.items():
        n2, s2, q2 = now[name]
        same = n == n2 and math.isclose(s, s2, rel_tol=1e-6, abs_tol=1e-6)
        if not (same and math.isclose(q, q2, rel_tol=1e-6, abs_tol=1e-6)):
            raise ValueError(
                f"PolicyTrainer.load_checkpoint: the reference differs from {where}'s at "
                f"{name!r} (sum {s2:.6g} instead of {s:.6g}), and a resumed run must keep the "
                "initial policy as its reference; build the policy from the same initial model"
            )


# ---------------------------------------------------------------------- helpers
def _optimizer_state(trainer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _quiet():
        return get_optimizer_state_dict(trainer.model, trainer.optimizer)


def _model_state(trainer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(trainer.model)


def _group(trainer: Any) -> Any:
    return trainer.dp.everyone if trainer.dp.sharded else None


@contextmanager
def _quiet():
    """DCP warns that it runs "in a single process" when torch.distributed is not initialized:
    that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


__all__ = [
    "check_reference",
    "fingerprint",
    "load_trainer",
    "load_weights",
    "save_trainer",
    "save_weights",
]
