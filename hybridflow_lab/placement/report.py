"""Ranked plans as a text table, and the check of the simulator against the paper's placement findings (section 8)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridflow_lab.placement.automap import AutoMapper, MappingPlan
from hybridflow_lab.placement.hardware import HardwareProfile
from hybridflow_lab.placement.workload import LLAMA, Workload

# Section 8: colocating all models wins at 16-64 GPUs; split wins for 13B at 96 and 34B at 96-128 GPUs;
# standalone wins for 13B at 128 GPUs. Cells the paper does not discuss are left out.
PAPER_WINNERS = {
    **{(size, devices): "colocate" for size in LLAMA for devices in (16, 32, 64)},
    ("13B", 96): "split", ("34B", 96): "split", ("34B", 128): "split", ("13B", 128): "standalone",
}


def plans_table(plans: Sequence[MappingPlan]) -> str:
    """One line per plan: rank, kind, predicted seconds per stage and in total, the sets."""
    if not plans:
        return "no placement fits: add devices or a profile with more memory"
    stages = list(plans[0].stage_s)
    header = ["#", "kind", *[f"{s} s" for s in stages], "total s", "placement"]
    rows = [[str(rank), plan.kind, *[f"{plan.stage_s[s]:.3g}" for s in stages], f"{plan.total_s:.3g}",
             plan.describe()] for rank, plan in enumerate(plans, 1)]
    return text_table([header, *rows])


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as aligned text columns; the last column is not padded (it may be long)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]])
                     for row in rows)


def compare_with_paper(hardware: HardwareProfile, sizes: Sequence[str] = tuple(LLAMA),
                       device_counts: Sequence[int] = (16, 32, 64, 96, 128)) -> list[dict[str, Any]]:
    """The best placement kind per (model size, GPUs) for the paper's PPO workload, beside the paper's finding."""
    rows = []
    for size in sizes:
        for devices in device_counts:
            plans = AutoMapper(Workload.paper_ppo(size), hardware, devices).search(top=50)
            best_of_kind: dict[str, float] = {}
            for plan in plans:
                best_of_kind.setdefault(plan.kind, round(plan.total_s, 1))
            predicted = plans[0].kind if plans else "none fits"
            paper = PAPER_WINNERS.get((size, devices))
            # no verdict where the paper is silent, or where nothing fits the simulator's memory model
            agrees = None if paper is None or not plans else predicted == paper
            rows.append({"model": size, "gpus": devices, "predicted": predicted, "paper": paper, "agrees": agrees,
                         "best_s_by_kind": best_of_kind, "best_plan": plans[0].describe() if plans else ""})
    return rows


def paper_table(rows: Sequence[dict[str, Any]]) -> str:
    """``compare_with_paper``'s rows, one line each: predicted and published winner, and each kind's best seconds."""
    verdicts = {True: "agrees", False: "DISAGREES", None: "-"}
    return "\n".join(f"{row['model']:>4} {row['gpus']:>4} GPUs  predicted {row['predicted']:<10} paper "
                     f"{row['paper'] or '-':<10} {verdicts[row['agrees']]:<15} {row['best_s_by_kind']}" for row in rows)
