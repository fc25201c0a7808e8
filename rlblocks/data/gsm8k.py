"""GSM8K (Cobbe et al. 2021, arXiv 2110.14168) in its released layout.

Each row has ``question`` and ``answer``, where ``answer`` is a worked solution whose last line
is ``#### <number>``, e.g. ``"Natalia sold 48/2 = <<48/2=24>>24 clips in May. …\\n#### 72"``.
`gsm8k` reads a parquet / jsonl / json / csv file in that layout (the Hugging Face
``openai/gsm8k`` parquet files, or a local copy) and makes the ground truth the number after
the last ``####`` (thousands separators removed: ``1,000`` -> ``1000``), keeping the full
solution in ``metadata["solution"]``.
"""

from __future__ import annotations

from typing import Any

from rlblocks.data.dataset import PromptDataset
from rlblocks.data.names import DATA
from rlblocks.data.prompts import (
    HASH_INSTRUCTION,
    Source,
    instruction_template,
    load_prompts,
    read_rows,
)

__all__ = ["gsm8k", "gsm8k_final_answer"]


def gsm8k_final_answer(solution: str) -> str | None:
    """The text after the last ``####`` of a GSM8K solution, without commas or spaces.

    ``"…\\n#### 1,200"`` -> ``"1200"``; None when there is no ``####`` or nothing after it.
    """
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "").replace(" ", "")
    return answer or None


@DATA.register("gsm8k")
def gsm8k(
    source: Source,
    *,
    instruction: str | None = HASH_INSTRUCTION,
    **load_kwargs: Any,
) -> PromptDataset:
    """GSM8K prompts from a file (or Dataset, or list of dicts) in the GSM8K layout.

    The prompt is the question, then ``instruction`` after a space (None for the bare
    question). ``ground_truth`` is `gsm8k_final_answer` of ``answer``; ``metadata`` holds
    ``ground_truth``, ``data_source="gsm8k"`` and ``solution`` (the full ``answer`` text).
    ``load_kwargs`` go to `load_prompts` (``system``, ``chat``, ``keep``, ``tokenizer``,
    ``max_prompt_tokens``, ``overlong``). Raises ``ValueError`` naming the row whose answer
    has no ``#### <number>``.
    """
    extra = load_kwargs.pop("keep", ())
    keep_all = extra is True  # every column, "solution" with them
    keep = True if keep_all else ("solution", *extra)
    named = [] if keep_all else list(extra)
    rows, _ = read_rows(source, columns=["question", "answer", *named], all_columns=keep_all)
    prepared = []
    for index, row in enumerate(rows):
        solution = row["answer"]
        truth = gsm8k_final_answer(solution) if isinstance(solution, str) else None
        if truth is None:
            raise ValueError(
                f"gsm8k: {rows.where(index)}, column 'answer': expected a solution ending in "
                f"'#### <number>', got {solution!r:.80}; fix that row, or load the file with "
                "rb.data.load_prompts"
            )
        prepared.append({**row, "solution": solution, "ground_truth": truth})
    return load_prompts(
        rows.like(prepared),  # keeps the file and lines for load_prompts' errors
        prompt="question",
        ground_truth="ground_truth",
        template=instruction_template(instruction),
        keep=keep,
        data_source="gsm8k",
        **load_kwargs,
    )
