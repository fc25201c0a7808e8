"""Draw docs/images/architecture.svg: one RL step as the blocks pass data to each other.

    python scripts/draw_architecture.py        # rewrites docs/images/architecture.svg

The picture is the data flow of docs/architecture.md ("One step of RL"): every arrow is one
line of user code, and the placement decides where the blocks inside its frame run.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parents[1] / "docs" / "images" / "architecture.svg"

#: name -> (x, y, width, height, title, subtitle)
BOXES = {
    "data": (0.3, 4.6, 2.6, 0.9, "prompt data", "rb.data.PromptBatches"),
    "engine": (4.0, 4.6, 3.2, 0.9, "RolloutEngine", "HFEngine · VLLMEngine · AgentEngine"),
    "rollouts": (8.3, 4.6, 2.6, 0.9, "Rollouts", "ids · masks · log-probs"),
    "reward": (8.3, 2.9, 2.6, 0.9, "RewardFn", "rb.rewards · from_trl · from_verl"),
    "advantage": (4.0, 2.9, 3.2, 0.9, "advantage estimator", "grpo · rloo · gae · ..."),
    "trainer": (4.0, 1.2, 3.2, 0.9, "PolicyTrainer.step", "loss_fn + aggregate, AdamW"),
    "resharder": (0.3, 1.2, 2.6, 0.9, "Resharder", "shared · buckets · LoRA adapter"),
}
#: (from, to, label)
ARROWS = [
    ("data", "engine", "prompts"),
    ("engine", "rollouts", "generate(\ngroup_size=g)"),
    ("rollouts", "reward", "reward_fn(ro)"),
    ("reward", "advantage", "rewards (b)"),
    ("advantage", "trainer", "advantages (b t)"),
    ("trainer", "resharder", "new weights"),
    ("resharder", "engine", "sync"),
]


def anchor(name: str, toward: str) -> tuple[float, float]:
    """The middle of the side of box ``name`` that faces box ``toward``."""
    x, y, w, h, *_ = BOXES[name]
    tx, ty, tw, th, *_ = BOXES[toward]
    dx, dy = (tx + tw / 2) - (x + w / 2), (ty + th / 2) - (y + h / 2)
    if abs(dx) > abs(dy):
        return (x + w, y + h / 2) if dx > 0 else (x, y + h / 2)
    return (x + w / 2, y + h) if dy > 0 else (x + w / 2, y)


def main() -> None:
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable, sharp
    fig, ax = plt.subplots(figsize=(11.5, 6.2))
    ax.set_xlim(0, 11.2)
    ax.set_ylim(0, 6.4)
    ax.axis("off")
    frame = FancyBboxPatch((3.7, 0.55), 7.45, 5.25, boxstyle="round,pad=0.05,rounding_size=0.2",
                           fill=False, linestyle="--", linewidth=1.2, edgecolor="#7a7a7a")
    ax.add_patch(frame)
    ax.text(3.85, 0.87, "Placement: Local() runs these blocks in this process;\n"
            "Ray(workers=N) runs engines and an FSDP2 trainer in worker processes",
            fontsize=8.5, color="#555555", va="center")
    for x, y, w, h, title, subtitle in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    facecolor="#eef3fb", edgecolor="#3b6fb6", linewidth=1.4))
        ax.text(x + w / 2, y + h * 0.63, title, ha="center", va="center", fontsize=11.5,
                fontweight="bold", color="#1d3557")
        ax.text(x + w / 2, y + h * 0.27, subtitle, ha="center", va="center", fontsize=8.5,
                color="#333333")
    for start, end, label in ARROWS:
        a, b = anchor(start, end), anchor(end, start)
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=14, linewidth=1.3,
                                     color="#444444", shrinkA=2, shrinkB=2))
        mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
        ax.text(mx, my + 0.12, label, ha="center", va="bottom", fontsize=8.5, color="#444444",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    ax.text(0.3, 6.05, "One RL step: every arrow is one line of your code", fontsize=13,
            fontweight="bold", color="#1d3557")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, bbox_inches="tight", metadata={"Date": None})
    print("wrote", OUT)


if __name__ == "__main__":
    main()
