"""The trainer: the Lab (single controller of a run), dataflows per algorithm, SFT, evaluation."""
