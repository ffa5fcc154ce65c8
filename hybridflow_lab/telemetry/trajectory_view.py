"""A multi-turn trajectory, turn by turn, for display: the policy's turns (trained on, with their rewards) and the
observations between them (context the loss never sees), as rows of plain data and as HTML."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

POLICY = "policy"
POLICY_STYLE = "background:#e8f3e8;border-left:3px solid #2e7d32"
CONTEXT_STYLE = "background:#f1f1f1;border-left:3px solid #9e9e9e;color:#616161;font-style:italic"


def trajectory_parts(segments: Sequence[Sequence[str]], turn_rewards: Sequence[float]) -> list[dict[str, Any]]:
    """``segments`` (``(role, text)`` in order, as ``Trajectory.segments`` gives them) as parts: each policy turn
    with its reward and token-level training flag, each observation flagged as not trained on."""
    rewards = iter(turn_rewards)
    parts = []
    for role, text in segments:
        policy = role == POLICY
        parts.append({"role": role, "text": text, "trained": policy, "reward": next(rewards, 0.0) if policy else None})
    return parts


def trajectory_html(parts: Sequence[Mapping[str, Any]]) -> str:
    """``parts`` (``trajectory_parts``) as HTML: policy turns on green with their reward, observations grey and
    italic, labelled as not trained on."""
    rows = []
    for part in parts:
        text = html.escape(str(part["text"]))
        if part["trained"]:
            label = f"policy · trained · reward {float(part['reward']):.3f}"
            style = POLICY_STYLE
        else:
            label = f"{part['role']} · context, not trained on"
            style = CONTEXT_STYLE
        rows.append(f"<div style='{style};margin:2px 0;padding:2px 6px'><small><b>{label}</b></small>"
                    f"<div style='white-space:pre-wrap;font-family:monospace'>{text}</div></div>")
    return f"<div class='hybridflow-trajectory'>{''.join(rows)}</div>"
