"""One batch, token by token: why each token counted, was clipped or was masked.

    view = rb.notebook.inspect(ro, policy=policy, advantages=adv, clip=(0.2, 0.28))
    print(view)                        # a compact table for a terminal
    view                               # in Jupyter: the tokens as coloured spans
    view.widget(color="ratio")         # a column picker (ipywidgets), any numeric/bool column
    df = view.frame                    # a pandas.DataFrame, one row per token

One row per real token (prompt and response; padding is left out), with these columns:

    row, position        the batch row, and the token's position among the row's real tokens
    token_id, text       the id, and the token decoded alone (the id when no tokenizer is known)
    prompt, response     real prompt token; policy token (``response_mask``: counts in the loss)
    tool                 real response token the policy did not sample (a tool observation)
    rollout_lp           the engine's log-prob (``rollout_logprobs``), on policy tokens
    old_lp               π_old (``old_logprobs``), only when a policy scores the batch too
    trainer_lp           the trainer's: ``policy.logprobs(rollouts)``, else ``old_logprobs``
    diff, ratio          trainer_lp − rollout_lp, and exp(diff)
    ppo_ratio, is_ratio  with ``old_lp``: π_θ / π_old = exp(trainer_lp − old_lp), the ratio
                         inside the PPO loss, and π_old / π_rollout = exp(old_lp − rollout_lp),
                         the ratio of an off-policy correction (`rlblocks.losses.offpolicy`)
    advantage            the token's advantage, on policy tokens
    clipped              PPO's clip is active: A > 0 and r > 1 + ε_high, or A < 0 and
                         r < 1 − ε_low (`rlblocks.losses.clipped_surrogate`'s rule: the
                         clipped branch is the larger loss, so the token has no gradient)
    dual_clipped         A < 0 and r > dual_clip (the dual clip caps the loss)
    masked               not a policy token, or a correction ratio outside
                         ``bounds=(low, high)`` (a token mask such as IcePop's drops it)
    why                  the first reason of: prompt, tool, ratio < low, ratio > high,
                         clip high, clip low, dual clip; "" for a token trained on as it is
    policy_version       the weight version that sampled the row, and the row's staleness
    staleness            (updates between those weights and π_old), when the batch has them

The clip's r is ``ppo_ratio`` and the bounds' is ``is_ratio`` when the batch has π_old and a
policy scores it (an asynchronous run with π_old recomputed: the PPO ratio is taken against
π_old, the correction's against the engine); otherwise both are ``ratio``: π_θ / π_rollout when
π_old is the engine's own log-probs (the PPO loss's ratio), π_old / π_rollout from
``old_logprobs`` alone (the correction's).

A value that does not apply is NaN (a prompt token has no log-prob). The decisions are written
out here rather than imported from `rlblocks.losses`: the notebook layer builds on the batch
type only, and ``tests/notebook/test_inspector.py`` checks them against the losses themselves.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlblocks.rollouts import Rollouts

__all__ = ["COLUMNS", "BatchView", "inspect"]

#: The columns of `BatchView`, in order (``old_lp``, ``ppo_ratio`` and ``is_ratio`` only with π_old
#: and a policy; ``policy_version`` and ``staleness`` only when the batch has them).
COLUMNS = (
    "row", "position", "token_id", "text", "prompt", "response", "tool", "rollout_lp", "old_lp",
    "trainer_lp", "diff", "ratio", "ppo_ratio", "is_ratio", "advantage", "clipped",
    "dual_clipped", "masked", "why", "policy_version", "staleness",
)  # fmt: skip

#: (column, header, width) of the terminal table: 100 characters with the separators.
TEXT_LAYOUT = (
    ("row", "row", 4), ("position", "pos", 4), ("token_id", "id", 6), ("text", "text", 14),
    ("kind", "kind", 6), ("rollout_lp", "rollout", 8), ("trainer_lp", "trainer", 8),
    ("ratio", "ratio", 7), ("advantage", "adv", 7), ("flags", "c d m", 5), ("why", "why", 10),
    ("policy_version", "ver", 4),
)  # fmt: skip

#: Colour of a positive value (red), a negative one (blue) and a True flag (orange), as RGB.
POSITIVE, NEGATIVE, FLAG = (220, 50, 47), (38, 139, 210), (230, 126, 34)


def inspect(
    rollouts: Rollouts,
    *,
    policy: Any = None,
    tokenizer: Any = None,
    advantages: Tensor | None = None,
    clip: tuple[float, float] = (0.2, 0.2),
    dual_clip: float | None = 3.0,
    bounds: tuple[float, float] | None = None,
) -> BatchView:
    """The per-token view of ``rollouts`` (module docstring for the columns).

    Args:
        rollouts: the batch; ``rollout_logprobs``, ``old_logprobs``, ``advantages`` and
            the provenance (``policy_version``, ``staleness``) are read when present.
        policy: anything with ``logprobs(rollouts) -> (b t)`` (a ``PolicyTrainer`` or its Ray
            handle): its log-probs are the trainer column, π_θ; without it, ``old_logprobs``.
            Its ``tokenizer`` decodes the tokens when none is given.
        tokenizer: decodes each token (``tokenizer.decode([id])``).
        advantages: ``(b t)`` or ``(b)`` (one per row); defaults to ``rollouts.advantages``.
        clip: (ε_low, ε_high) of the clipped surrogate, as passed to the loss.
        dual_clip: the loss's dual-clip constant c (its default, 3.0), or None.
        bounds: (low, high) ratio bounds of a token-level masking correction (IcePop's
            ``MaskedIS(low=, high=)``), or None.
    """
    _check_settings(clip, dual_clip, bounds)
    trainer = policy.logprobs(rollouts) if policy is not None else rollouts.old_logprobs
    old = rollouts.old_logprobs if policy is not None else None
    advantages = rollouts.advantages if advantages is None else advantages
    tokenizer = tokenizer if tokenizer is not None else getattr(policy, "tokenizer", None)
    columns = _token_columns(rollouts, trainer, old, _per_token(advantages, rollouts))
    columns |= _decisions(columns, clip, dual_clip, bounds)
    columns["text"] = _texts(columns["token_id"], tokenizer)
    for name in ("policy_version", "staleness"):  # per row: getattr, as older batches lack them
        per_row = getattr(rollouts, name, None)
        if per_row is not None:
            columns[name] = [int(per_row[r]) for r in columns["row"]]
    return BatchView({name: columns[name] for name in COLUMNS if name in columns})


class BatchView:
    """The columns of `inspect`, as plain lists of equal length; views of them as a
    ``DataFrame`` (`frame`), a terminal table (`text`, ``str(view)``) and HTML spans coloured
    by a column (`html`, `widget`, and ``_repr_html_`` for Jupyter)."""

    def __init__(self, columns: dict[str, list[Any]]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns["row"])

    @property
    def frame(self) -> Any:
        """A ``pandas.DataFrame``, one row per token (the ``pandas`` extra)."""
        from rlblocks.base.extras import require

        pd = require("pandas", needed_by="BatchView.frame")
        return pd.DataFrame(self.columns)

    def only(self, column: str, value: bool = True) -> BatchView:
        """The tokens where the boolean ``column`` is ``value``: ``view.only("clipped")``,
        ``view.only("prompt", False)`` (the responses), e.g. to print just those."""
        flags = [n for n, v in self.columns.items() if v and isinstance(v[0], bool)]
        if column not in flags and (column not in self.columns or self.columns[column]):
            raise ValueError(
                f"BatchView.only: {column!r} is not a boolean column; pass one of {flags}"
            )
        keep = [i for i, flag in enumerate(self.columns[column]) if flag == value]
        return BatchView({name: [values[i] for i in keep] for name, values in self.columns.items()})

    def colorable(self) -> list[str]:
        """The columns `html` can colour by: the numeric and the boolean ones."""
        return [n for n, v in self.columns.items() if v and not isinstance(v[0], str)]

    # ------------------------------------------------------------------ terminal
    def text(self, *, max_lines: int = 40) -> str:
        """A table of at most ``max_lines`` tokens, 100 characters wide: the first and the last
        half, with the count of the tokens left out between them. ``kind`` is prompt, policy
        or tool; the flags are c (clipped), d (dual clipped) and m (masked)."""
        layout = [c for c in TEXT_LAYOUT if c[0] != "policy_version" or c[0] in self.columns]
        lines = [" ".join(_cell(header, width) for _, header, width in layout).rstrip()]
        n, shown = len(self), max(max_lines, 2)
        keep = range(n) if n <= shown else [*range(shown // 2), *range(n - shown + shown // 2, n)]
        previous = -1
        for i in keep:
            if i != previous + 1:
                lines.append(f"... {i - previous - 1} tokens not shown ...")
            cells = (_cell(self._text_value(key, i), width) for key, _, width in layout)
            lines.append(" ".join(cells).rstrip())
            previous = i
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        rows = len(set(self.columns["row"]))
        return f"BatchView({len(self)} tokens in {rows} rows; .frame, .text(), .widget())"

    def _text_value(self, key: str, i: int) -> str:
        c = self.columns
        if key == "kind":
            return "prompt" if c["prompt"][i] else "policy" if c["response"][i] else "tool"
        if key == "flags":
            flags = zip("cdm", (c["clipped"][i], c["dual_clipped"][i], c["masked"][i]))
            return " ".join(f if on else "." for f, on in flags)
        value = c[key][i]
        if key == "text":
            return repr(value)[1:-1]
        if isinstance(value, float):
            return "" if math.isnan(value) else f"{value:.3f}"
        return str(value)

    # ------------------------------------------------------------------ notebook
    def html(self, *, color: str = "ratio", max_tokens: int = 600) -> Html:
        """Each batch row as a line of token spans, the background coloured by ``color`` (a
        numeric or boolean column), every column in the hover title. Numbers are coloured
        around 0 (the ratio around 1, on a log scale), red above, blue below, the alpha
        proportional to the distance over the largest one; True flags are orange. At most
        ``max_tokens`` tokens, then the count of those left out. A ``str`` that Jupyter shows
        as HTML when it is a cell's last expression."""
        if color not in self.colorable():
            raise ValueError(
                f"BatchView.html: cannot colour by {color!r}; pass one of {self.colorable()}"
            )
        # The ratio is coloured by its log, trainer_lp - rollout_lp: around 1, symmetric.
        backgrounds = _backgrounds(self.columns["diff" if color == "ratio" else color])
        parts = [f'<div class="rb-inspect"><div>coloured by <b>{html.escape(color)}</b></div>']
        row = None
        for i in range(min(len(self), max_tokens)):
            if self.columns["row"][i] != row:
                row = self.columns["row"][i]
                parts.append(("</div>" if i else "") + f"<div><b>row {row}</b> ")
            parts.append(self._span(i, backgrounds[i]))
        parts.append("</div>" if len(self) else "")
        if len(self) > max_tokens:
            parts.append(f"<div>... {len(self) - max_tokens} tokens not shown</div>")
        return Html("".join(parts) + "</div>")

    def _span(self, i: int, background: str) -> str:
        title = "\n".join(f"{name}={_plain(values[i])}" for name, values in self.columns.items())
        style = f"background:{background};white-space:pre-wrap"
        if self.columns["prompt"][i]:
            style += ";opacity:0.6"
        text = html.escape(self.columns["text"][i].replace("\n", "\u21b5\n"))
        return f'<span title="{html.escape(title)}" style="{style}">{text}</span>'

    def _repr_html_(self) -> str:
        return str(self.html())

    def widget(self, *, color: str = "ratio") -> Any:
        """A column picker over `html` (ipywidgets, the ``notebook`` extra); without ipywidgets
        the HTML of ``color`` itself, which Jupyter shows as well."""
        try:
            import ipywidgets as w
        except ImportError:
            return self.html(color=color)
        picker = w.Dropdown(options=self.colorable(), value=color, description="colour by")
        out = w.HTML(self.html(color=color))
        picker.observe(
            lambda change: setattr(out, "value", self.html(color=change["new"])), "value"
        )
        return w.VBox([picker, out])


class Html(str):
    """An HTML string that Jupyter shows rendered (``_repr_html_``) and the rest of Python as
    the string it is."""

    def _repr_html_(self) -> str:
        return str(self)


# ---------------------------------------------------------------------- the columns
def _check_settings(
    clip: tuple[float, float], dual_clip: float | None, bounds: tuple[float, float] | None
) -> None:
    low, high = clip
    if not (0 <= low < 1 and high >= 0):
        raise ValueError(
            f"inspect: clip={clip} is not (ε_low, ε_high) with 0 <= ε_low < 1 <= 1 + ε_high; "
            "pass the loss's own clip, e.g. (0.2, 0.28)"
        )
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"inspect: dual_clip={dual_clip} is not > 1; pass the loss's c, or None")
    if bounds is not None and not 0 <= bounds[0] < bounds[1]:
        raise ValueError(
            f"inspect: bounds={bounds} is not (low, high) with 0 <= low < high; pass the "
            "correction's ratio bounds, e.g. (0.5, 2.0)"
        )


def _per_token(advantages: Tensor | None, rollouts: Rollouts) -> Tensor | None:
    """``advantages`` as ``(b t)`` (a ``(b)`` one repeated over the row); shapes checked."""
    if advantages is None:
        return None
    b, t = rollouts.response_ids.shape
    advantages = torch.as_tensor(advantages).detach().float().cpu()
    if advantages.shape == (b,):
        return advantages[:, None].expand(b, t)
    if advantages.shape != (b, t):
        raise ValueError(
            f"inspect: advantages has shape {tuple(advantages.shape)}, expected ({b}, {t}) or "
            f"({b},); pass the advantages of this batch"
        )
    return advantages


def _token_columns(
    ro: Rollouts, trainer: Tensor | None, old: Tensor | None, adv: Tensor | None
) -> dict[str, list]:
    """Every column but the decisions and the text, for the real tokens in row order
    (``old_lp`` and its ratios only when ``old`` is given)."""
    tp = ro.prompt_ids.shape[1]
    real = ro.attention_mask.cpu()
    policy = torch.cat([torch.zeros_like(real[:, :tp]), ro.response_mask.cpu()], dim=1)
    response = torch.cat([torch.zeros_like(real[:, :tp]), real[:, tp:]], dim=1)
    nan = torch.full((ro.batch_size, tp), math.nan)

    def aligned(values: Tensor | None, where: Tensor) -> Tensor:
        if values is None:
            return torch.full(real.shape, math.nan)[real]
        full = torch.cat([nan, values.detach().float().cpu()], dim=1)
        return torch.where(where, full, math.nan)[real]

    rollout_lp = aligned(ro.rollout_logprobs, policy)
    trainer_lp = aligned(trainer, response)
    diff = torch.where(policy[real], trainer_lp - rollout_lp, math.nan)
    rows = torch.arange(ro.batch_size)[:, None].expand_as(real)
    against_old = {}
    if old is not None:
        old_lp = aligned(old, policy)
        against_old = {
            "old_lp": old_lp.tolist(),
            "ppo_ratio": (trainer_lp - old_lp).exp().tolist(),
            "is_ratio": (old_lp - rollout_lp).exp().tolist(),
        }
    return {
        "row": rows[real].tolist(),
        "position": (real.long().cumsum(1) - 1)[real].tolist(),
        "token_id": ro.input_ids.cpu()[real].tolist(),
        "prompt": (real & ~response)[real].tolist(),
        "response": policy[real].tolist(),
        "tool": (response & ~policy)[real].tolist(),
        "rollout_lp": rollout_lp.tolist(),
        "trainer_lp": trainer_lp.tolist(),
        "diff": diff.tolist(),
        "ratio": diff.exp().tolist(),
        "advantage": aligned(adv, policy).tolist(),
        **against_old,
    }


def _decisions(
    columns: dict[str, list],
    clip: tuple[float, float],
    dual_clip: float | None,
    bounds: tuple[float, float] | None,
) -> dict[str, list]:
    """clipped, dual_clipped, masked and why, from the ratios (module docstring: which one)
    and the advantage's sign (a NaN compares False: a token without a ratio is never
    clipped)."""
    ppo = torch.tensor(columns.get("ppo_ratio", columns["ratio"]))
    correction = torch.tensor(columns.get("is_ratio", columns["ratio"]))
    adv = torch.tensor(columns["advantage"])
    high = (adv > 0) & (ppo > 1 + clip[1])
    low = (adv < 0) & (ppo < 1 - clip[0])
    dual = (adv < 0) & (ppo > dual_clip) if dual_clip is not None else torch.zeros_like(high)
    below = correction < bounds[0] if bounds is not None else torch.zeros_like(high)
    above = correction > bounds[1] if bounds is not None else torch.zeros_like(high)
    policy = torch.tensor(columns["response"], dtype=torch.bool)
    reasons = [
        ("prompt", torch.tensor(columns["prompt"], dtype=torch.bool)),
        ("tool", torch.tensor(columns["tool"], dtype=torch.bool)),
        ("ratio < low", below),
        ("ratio > high", above),
        ("clip high", high),
        ("clip low", low),
        ("dual clip", dual),
    ]
    why = [""] * len(adv)
    for label, where in reversed(reasons):  # the first reason wins
        for i in where.nonzero().flatten().tolist():
            why[i] = label
    return {
        "clipped": (high | low).tolist(),
        "dual_clipped": dual.tolist(),
        "masked": (~policy | below | above).tolist(),
        "why": why,
    }


def _texts(ids: Sequence[int], tokenizer: Any) -> list[str]:
    """Each token decoded alone (each distinct id once), or the id as text."""
    if tokenizer is None:
        return [str(i) for i in ids]
    decoded = {i: tokenizer.decode([i]) for i in set(ids)}
    return [decoded[i] for i in ids]


# ---------------------------------------------------------------------- rendering helpers
def _backgrounds(values: Sequence[Any]) -> list[str]:
    """A CSS background per value (`BatchView.html`): booleans orange when True; numbers red
    above 0 and blue below, alpha = |v| / max |v| over the finite values (1 for an infinite
    one); NaN and 0 transparent."""
    if values and isinstance(values[0], bool):
        return [_rgba(FLAG, 0.6) if v else "transparent" for v in values]
    numbers = [float(v) for v in values]
    scale = max((abs(v) for v in numbers if math.isfinite(v)), default=0.0)
    out = []
    for v in numbers:
        if math.isnan(v) or v == 0:
            out.append("transparent")
        else:
            alpha = 1.0 if scale == 0 or math.isinf(v) else abs(v) / scale
            out.append(_rgba(POSITIVE if v > 0 else NEGATIVE, alpha))
    return out


def _rgba(rgb: tuple[int, int, int], alpha: float) -> str:
    return f"rgba({rgb[0]}, {rgb[1]}, {rgb[2]}, {alpha:.2f})"


def _cell(value: str, width: int) -> str:
    """``value`` cut or padded to ``width`` characters (a cut one ends in ~)."""
    return value[: width - 1] + "~" if len(value) > width else value.ljust(width)


def _plain(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)
