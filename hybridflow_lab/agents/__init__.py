"""Agentic rollouts: tools, environments, token-in/token-out trajectories and the multi-turn loop."""

from hybridflow_lab.agents.call_formats import CALL_FORMATS, CallFormat, MalformedCall, ToolCall
from hybridflow_lab.agents.environment import Environment, StepResult, ToolEnvironment, ToolPolicy
from hybridflow_lab.agents.loop import AgentLimits, run_episodes
from hybridflow_lab.agents.observations import ObservationRenderer
from hybridflow_lab.agents.tools import Tool, as_tool
from hybridflow_lab.agents.trajectory import Trajectory, Turn, trajectories_batch

__all__ = [
    "CALL_FORMATS",
    "AgentLimits",
    "CallFormat",
    "Environment",
    "MalformedCall",
    "ObservationRenderer",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolPolicy",
    "Trajectory",
    "Turn",
    "as_tool",
    "run_episodes",
    "trajectories_batch",
]
