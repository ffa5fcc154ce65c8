"""The base of roles that train a model with an engine: their checkpoint calls."""

from __future__ import annotations

from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.engines.train_base import TrainEngine


class TrainedRole(Worker):
    """A role with ``self.engine``; checkpoints go through it (collective on every rank)."""

    engine: TrainEngine

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)
        self.weights_loaded()

    def weights_loaded(self) -> None:
        """Called after a checkpoint replaced the weights."""
