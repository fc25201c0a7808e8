"""Export of a trained policy: a Hugging Face folder that transformers, peft and vLLM load.

``PolicyTrainer.save_pretrained`` and ``PolicyTrainer.push_to_hub`` are thin wrappers of
:func:`save_pretrained` and :func:`push_to_hub` here. Two forms of folder:

- **Full model** (any policy; LoRA with ``merge_lora=True``): ``model.safetensors`` (or shards
  ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` past
  ``max_shard_size``), ``config.json``, ``generation_config.json`` and the tokenizer's files.
  ``AutoModelForCausalLM.from_pretrained(folder)``, ``vllm serve folder`` and
  ``rb.rollout.VLLMEngine(folder)`` load it.
- **LoRA adapter** (``merge_lora=False``): peft's ``adapter_model.safetensors`` and
  ``adapter_config.json`` (and its README.md model card), plus ``generation_config.json`` and
  the tokenizer. ``peft.AutoPeftModelForCausalLM.from_pretrained(folder)`` loads it, reading
  the base model from ``base_model_name_or_path`` in ``adapter_config.json``.

Decisions worth knowing:

- **Exact weights.** The tensors written are those of ``trainer.named_weights()`` (LoRA merged
  into new tensors as W + scaling · B·A, the model itself untouched) in their own dtype, so a
  full-weight folder holds the parameters bit for bit; the adapter form is peft's own file of
  the adapter parameters, also bit for bit. Tied weights (an output head sharing the input
  embedding's parameter) are written once, under the first name ``state_dict`` gives them (the
  embedding's), as transformers writes them; transformers and vLLM re-tie them on load as
  ``tie_word_embeddings`` says.
- **Our own writer, not ``model.save_pretrained``.** The weights may be FSDP2 shards or a
  peft-wrapped model, whose ``save_pretrained`` would write the wrong thing; we write the
  gathered tensors with ``huggingface_hub.save_torch_state_dict`` and the config ourselves, with
  ``architectures`` (vLLM picks its model class by it) and ``dtype`` set from what is written.
  The names are those of ``model.state_dict()``: models whose transformers class renames or
  fuses weights when it loads a checkpoint (some mixture-of-experts classes) are not covered.
- **Data-parallel groups.** Every rank must call (the weights are all-gathered, bucket by
  bucket); only rank 0 of the group keeps them (on the CPU) and touches the file system, after
  the last collective, so an error while writing cannot leave a peer waiting. Other ranks
  return without writing. With several machines the folder is on rank 0's.
- **No half-written folder.** The files go into a hidden temporary sibling folder
  (``.<name>.partial-*``) renamed to ``folder`` once complete (``os.replace``: atomic on one
  file system); an error removes the temporary folder. An existing ``folder`` is replaced only
  if it is empty or holds an earlier export (``config.json`` or ``adapter_config.json``), by
  renaming it aside first: never a mix of old and new files. Anything else is refused.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

    from rlblocks.trainer.parallel import DataParallel, SingleProcess

DEFAULT_COMMIT_MESSAGE = "Upload a policy trained with rlblocks"
EXPORT_MARKERS = ("config.json", "adapter_config.json")  # an existing export may be replaced


class Exportable(Protocol):
    """What export needs of a trainer (``PolicyTrainer`` has it all)."""

    model: nn.Module  # a Hugging Face causal LM, peft-wrapped when has_adapter
    tokenizer: Any  # saved with the weights when not None
    has_adapter: bool
    dp: SingleProcess | DataParallel  # its rank: 0 writes

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full weights under their Hugging Face names (LoRA merged)."""


def save_pretrained(
    trainer: Exportable,
    folder: str | Path,
    *,
    merge_lora: bool = True,
    base_model: str | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the policy as a Hugging Face folder (module docstring); returns ``folder``.

    ``merge_lora``: with a LoRA policy, True writes the full model with the adapters merged
    (W + scaling · B·A), False peft's adapter folder. ``base_model``: the adapter form's
    ``base_model_name_or_path`` (default: the one peft recorded, the folder or hub name the base
    model was loaded from); it must name a model ``from_pretrained`` can load, the weights the
    adapter was trained on. ``max_shard_size``: largest safetensors file of the full form.
    Every rank of a data-parallel group must call; rank 0 writes (module docstring).
    """
    folder = Path(folder).expanduser()
    rank = trainer.dp.process  # with tensor parallelism, one process of many has dp.rank 0
    if trainer.has_adapter and not merge_lora:
        if rank == 0:  # LoRA policies are never sharded: no collective to join
            with _replacing(folder) as partial:
                _write_adapter(trainer, partial, base_model)
        return folder
    weights = _gathered_weights(trainer, keep=rank == 0)
    if rank == 0:
        with _replacing(folder) as partial:
            _write_full(trainer, partial, weights, max_shard_size)
    return folder


def push_to_hub(
    trainer: Exportable,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    revision: str | None = None,
    merge_lora: bool = True,
    base_model: str | None = None,
    max_shard_size: int | str = "5GB",
) -> CommitInfo | None:
    """:func:`save_pretrained` into a temporary folder, then upload it to the Hugging Face hub.

    ``HfApi(token=token).create_repo(repo_id, private=private, exist_ok=True)`` and
    ``upload_folder`` (one commit with ``commit_message``, on ``revision``: default the main
    branch). ``token`` None: the one ``huggingface-cli login`` stored or ``HF_TOKEN``. Returns
    huggingface_hub's ``CommitInfo`` (a ``str``: the commit's URL; ``.oid`` its hash) on rank 0
    and None on the other ranks, which only join the gathering.
    With ``HF_HUB_OFFLINE=1`` huggingface_hub raises ``OfflineModeIsEnabled`` once the folder
    is written; the temporary folder is removed in every case.
    """
    with tempfile.TemporaryDirectory(prefix="rlblocks-push-") as scratch:
        folder = save_pretrained(
            trainer,
            Path(scratch) / "policy",
            merge_lora=merge_lora,
            base_model=base_model,
            max_shard_size=max_shard_size,
        )
        if trainer.dp.process != 0:
            return None
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message,
            revision=revision,
            repo_type="model",
        )


# ---------------------------------------------------------------------- the full model
def _gathered_weights(trainer: Exportable, *, keep: bool) -> dict[str, Tensor]:
    """``named_weights()`` on the CPU, each tied parameter under its first name only; every
    rank iterates (a sharded trainer all-gathers), only ``keep`` holds on to them (rank 0)."""
    tied = tied_names(hf_model(trainer)) if keep else {}
    weights: dict[str, Tensor] = {}
    for name, tensor in trainer.named_weights():
        if not keep:
            continue  # the gathered bucket is freed as we go
        tensor = tensor.detach().cpu()
        if name not in tied:
            weights[name] = _owning(tensor)
        elif not _same_bits(tensor, weights[tied[name]]):
            # LoRA on a tied embedding or head: merged, the two differ, and a checkpoint
            # that says tie_word_embeddings cannot hold both.
            raise NotImplementedError(
                f"save_pretrained: {name} is tied to {tied[name]} but differs from it after "
                "merging LoRA; export with merge_lora=False, or do not adapt tied embeddings"
            )
    return weights


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (``torch.equal`` says a tensor holding NaN
    differs from itself: a tied weight that turned NaN was reported as a LoRA merge)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{name: first name}`` for every parameter ``state_dict`` lists again under another name
    (``lm_head.weight`` → ``model.embed_tokens.weight``), with peft's ``.base_layer.`` removed."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        name = name.replace(".base_layer.", ".")
        if id(value) in first:
            tied[name] = first[id(value)]
        else:
            first[id(value)] = name
    return tied


def _owning(tensor: Tensor) -> Tensor:
    """``tensor``, copied if it is a view into a larger buffer (a gathered bucket): safetensors
    refuses to write a tensor that covers only part of its storage."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return (
        tensor
        if whole and tensor.is_contiguous()
        else tensor.clone(memory_format=torch.contiguous_format)
    )


def _write_full(
    trainer: Exportable, folder: Path, weights: dict[str, Tensor], max_shard_size: int | str
) -> None:
    from huggingface_hub import save_torch_state_dict

    model = hf_model(trainer)
    save_torch_state_dict(weights, folder, max_shard_size=max_shard_size)
    config: Any = copy.deepcopy(model.config)  # a transformers PreTrainedConfig
    config.architectures = [_model_class(model).__name__]
    config.dtype = _main_dtype(weights)
    config.save_pretrained(folder)
    _write_generation_and_tokenizer(trainer, folder)


def hf_model(trainer: Exportable) -> nn.Module:
    """The Hugging Face model under the trainer's wrappers (peft's, not FSDP's)."""
    return trainer.model.get_base_model() if trainer.has_adapter else trainer.model  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module


def _model_class(model: nn.Module) -> type:
    """The transformers class of ``model``: FSDP2's ``fully_shard`` swaps in a subclass
    ``FSDP<Class>``, whose name neither transformers nor vLLM knows."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _main_dtype(weights: dict[str, Tensor]) -> torch.dtype:
    """The dtype of most floating-point elements: what ``from_pretrained(dtype="auto")`` uses."""
    sizes: dict[torch.dtype, int] = {}
    for tensor in weights.values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


def _write_generation_and_tokenizer(trainer: Exportable, folder: Path) -> None:
    generation_config(hf_model(trainer), trainer.tokenizer).save_pretrained(folder)
    if trainer.tokenizer is not None:
        trainer.tokenizer.save_pretrained(folder)


def generation_config(model: nn.Module, tokenizer: Any = None) -> Any:
    """The model's ``generation_config`` (one derived from its config if it has none), with
    ``eos_token_id`` and ``pad_token_id`` taken from ``tokenizer`` where it sets none.

    Generation stops at ``eos_token_id`` in transformers and vLLM (vLLM reads this file for its
    stop tokens and default sampling settings), so it must name the end-of-turn token the policy
    was trained to emit.
    """
    from transformers import GenerationConfig

    own = getattr(model, "generation_config", None)
    config = (
        copy.deepcopy(own) if own is not None else GenerationConfig.from_model_config(model.config)  # type: ignore[arg-type]  # Module.__getattr__ is typed Tensor | Module
    )
    if tokenizer is not None:
        if config.eos_token_id is None:
            config.eos_token_id = tokenizer.eos_token_id
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
    return config


# ---------------------------------------------------------------------- the LoRA adapter
def _write_adapter(trainer: Exportable, folder: Path, base_model: str | None) -> None:
    """peft's adapter files, ``base_model_name_or_path`` set to ``base_model`` if given (in the
    file written: the trainer's peft config is left alone), the generation config, tokenizer."""
    trainer.model.save_pretrained(folder)  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    if base_model is not None:
        config["base_model_name_or_path"] = str(base_model)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not config.get("base_model_name_or_path"):
        warnings.warn(
            "save_pretrained(merge_lora=False): the adapter names no base model (the policy was "
            "not loaded from a folder or hub name), so AutoPeftModelForCausalLM cannot load it; "
            "pass base_model=<the base model's folder or hub name>",
            stacklevel=4,
        )
    _write_generation_and_tokenizer(trainer, folder)


# ---------------------------------------------------------------------- writing safely
@contextmanager
def _replacing(folder: Path) -> Iterator[Path]:
    """A fresh hidden sibling of ``folder`` to write into; renamed to ``folder`` on success,
    removed on error. An existing ``folder`` must be empty or an earlier export."""
    if folder.exists() and not _replaceable(folder):
        raise FileExistsError(
            f"save_pretrained: {folder} exists and is not an exported model (no "
            f"{' or '.join(EXPORT_MARKERS)}), so it is not replaced; choose another folder"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        yield partial
        partial.chmod(0o755)  # mkdtemp's 0o700 would hide the export from a serving user
        if folder.exists():
            aside = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(folder, aside)
            os.replace(partial, folder)
            shutil.rmtree(aside)
        else:
            os.replace(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _replaceable(folder: Path) -> bool:
    if not folder.is_dir():
        return False
    return not any(folder.iterdir()) or any((folder / m).is_file() for m in EXPORT_MARKERS)
