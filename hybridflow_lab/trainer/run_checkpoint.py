"""A run's checkpoint: every trained role and the controller's state for one step, written atomically."""

from __future__ import annotations

from pathlib import Path

from hybridflow_lab.config import LabConfig, to_dict
from hybridflow_lab.redact import redact
from hybridflow_lab.trainer import checkpointing
from hybridflow_lab.trainer.groups import RunGroups
from hybridflow_lab.trainer.prompt_stream import Position, PromptStream
from hybridflow_lab.trainer.run_state import RunState


def save_run(run_dir: Path, groups: RunGroups, state: RunState, position: Position, config: LabConfig) -> Path:
    """Checkpoint step ``state.step_index``: the trained groups, the state and the prompt stream's ``position``;
    a failure leaves the previous checkpoint intact and says so."""
    step = state.step_index
    staging = checkpointing.staging_dir(run_dir, step)
    try:
        groups.save(staging)
        source, next_uid = position
        controller = {**state.state_dict(), "next_uid": next_uid, "source": source,
                      "config": redact(to_dict(config))}
        return checkpointing.commit(run_dir, step, controller, config.trainer.keep_checkpoints)
    except BaseException as error:
        checkpointing.discard_staging(run_dir, step)
        previous = checkpointing.latest(run_dir)
        error.add_note(f"the checkpoint of step {step} was not written; "
                       + (f"{previous} is intact" if previous else "there is no earlier checkpoint"))
        raise


def load_run(path: Path, groups: RunGroups, state: RunState, prompts: PromptStream) -> None:
    """Restore the trained groups, the state and the prompt stream from checkpoint ``path`` (verified first)."""
    checkpointing.verify(path)
    controller = checkpointing.read_state(path)
    groups.load(path)
    state.load_state_dict(controller)
    prompts.restore((controller["source"], controller["next_uid"]))


def recovery_hint(run_dir: Path) -> str:
    """Where ``lab.recover()`` would continue from."""
    checkpoint = checkpointing.latest(run_dir)
    where = f"checkpoint {checkpoint} (step {checkpointing.read_state(checkpoint)['step']})" if checkpoint \
        else f"step 0 (no checkpoint under {run_dir / 'checkpoints'} yet)"
    return f"lab.recover() rebuilds the worker groups and continues from {where}"
