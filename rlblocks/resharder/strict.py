"""The checks before a sync: the whole transfer fits the engine, and both sides share a tokenizer.

A sync that stopped half way would leave an engine with some layers trained and others not; a
sync into a larger engine would leave its extra layers random and report success. So the
resharder compares what the trainer will send (``PolicyTrainer.weight_spec``) with what the
engine takes (``RolloutEngine.weight_spec``) before the first bucket is written, and refuses
the whole sync on any difference:

- **missing**: a weight the engine holds that the trainer does not send;
- **extra**: a weight the trainer sends that the engine does not hold;
- **shape**: the same name with another shape;
- **dtype**: another dtype, unless both are floating point. Engines cast what they load to
  their own precision (a float32 or float64 trainer into a bfloat16 engine is the usual
  setup, and the reverse loses nothing), so a float-to-float cast is allowed; a float into an
  integer or boolean tensor (or an integer of another width) is refused: that is another
  tensor, not another precision.

The tokenizers are compared too (:func:`check_tokenizers`): the engine turns prompts into ids
with its tokenizer and the trainer reads those ids with its embeddings, so a different
vocabulary or a different EOS id trains on text the engine never meant. Vocabulary (every
token and its id, as a size and a hash), BOS and EOS ids must agree; padding ids only when both
tokenizers have one (padding is masked out; an engine gives a tokenizer without one its EOS).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlblocks.interfaces import TensorSpec, WeightSpec

SHOWN = 3  # mismatches named in an error; the rest are counted


def cast_allowed(sent: TensorSpec, held: TensorSpec) -> bool:
    """True when the engine may load a tensor of ``sent``'s dtype into one of ``held``'s:
    the same dtype, or both floating point (module docstring)."""
    return sent.dtype == held.dtype or (
        sent.dtype.is_floating_point and held.dtype.is_floating_point
    )


def weight_mismatches(sent: WeightSpec, held: WeightSpec) -> list[tuple[str, str, str]]:
    """Every difference between the trainer's spec ``sent`` and the engine's ``held``, as
    ``(kind, name, detail)``: the engine's names in its order (missing, shape, dtype), then the
    trainer's extra names in its order."""
    found = []
    for name, want in held.items():
        have = sent.get(name)
        if have is None:
            found.append(("missing", name, f"trainer: none, engine: {_spec(want)}"))
        elif have.shape != want.shape:
            found.append(("shape", name, f"trainer: {_spec(have)}, engine: {_spec(want)}"))
        elif not cast_allowed(have, want):
            found.append(("dtype", name, f"trainer: {_spec(have)}, engine: {_spec(want)}"))
    for name, have in sent.items():
        if name not in held:
            found.append(("extra", name, f"trainer: {_spec(have)}, engine: none"))
    return found


def check_weights(sent: WeightSpec, held: WeightSpec) -> None:
    """Raise ``ValueError`` naming the first mismatches (name, shape and dtype on each side)
    and counting the rest, unless the trainer's ``sent`` fits the engine's ``held`` exactly."""
    found = weight_mismatches(sent, held)
    if not found:
        return
    counts = {kind: sum(k == kind for k, _, _ in found) for kind in _KINDS}
    lines = [f"  {name} ({kind}): {detail}" for kind, name, detail in found[:SHOWN]]
    if len(found) > SHOWN:
        lines.append(f"  ... and {len(found) - SHOWN} more")
    summary = ", ".join(f"{n} {_KINDS[kind]}" for kind, n in counts.items() if n)
    raise ValueError(
        f"Resharder: the trainer's weights do not fit the engine, nothing was copied "
        f"({summary}):\n" + "\n".join(lines)
    )


_KINDS = {
    "missing": "missing from the trainer",
    "extra": "unknown to the engine",
    "shape": "of another shape",
    "dtype": "of a dtype the engine cannot cast to",
}


def _spec(spec: TensorSpec) -> str:
    return f"{tuple(spec.shape)} {str(spec.dtype).removeprefix('torch.')}"


# ---------------------------------------------------------------------- tokenizers
def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What must agree between two tokenizers: the vocabulary (size and a hash of every
    ``token: id``) and the BOS, EOS and padding ids."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:12]
    return {
        "vocabulary": f"{len(vocab)} tokens, sha256 {digest}",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def check_tokenizers(trainer_tokenizer: Any, engine_tokenizer: Any) -> None:
    """Raise ``ValueError`` naming every field that differs (module docstring); nothing to
    check when either side has no tokenizer (a trainer built without one)."""
    if trainer_tokenizer is None or engine_tokenizer is None:
        return
    mine, theirs = tokenizer_identity(trainer_tokenizer), tokenizer_identity(engine_tokenizer)
    if None in (mine["pad_token_id"], theirs["pad_token_id"]):
        del mine["pad_token_id"], theirs["pad_token_id"]
    differ = [
        f"{key}: trainer {mine[key]}, engine {theirs[key]}"
        for key in mine
        if mine[key] != theirs[key]
    ]
    if mine["vocabulary"] != theirs["vocabulary"]:
        differ.append(_first_token_apart(trainer_tokenizer, engine_tokenizer))
    if differ:
        raise ValueError(
            "Resharder: the trainer and the engine use different tokenizers, nothing was "
            "copied (the engine's token ids would mean other text to the trainer); build the "
            "engine with the trainer's tokenizer. They differ in: " + "; ".join(differ)
        )


def _first_token_apart(trainer_tokenizer: Any, engine_tokenizer: Any) -> str:
    """The token of lowest id (on either side) that the two vocabularies give different ids,
    or that only one of them has."""
    mine, theirs = trainer_tokenizer.get_vocab(), engine_tokenizer.get_vocab()
    for token, i in sorted([*mine.items(), *theirs.items()], key=lambda item: item[1]):
        if mine.get(token) != theirs.get(token):
            return (
                f"first difference: {token!r} is {mine.get(token)} for the trainer, "
                f"{theirs.get(token)} for the engine"
            )
    return "first difference: none by token (the hashes differ)"
