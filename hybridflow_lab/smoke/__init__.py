"""The GPU smoke check (``scripts/gpu_smoke.sh``, ``python -m hybridflow_lab.smoke``): versions, placement,
every training engine, resharding, vLLM's weight sync and sleep, and a colocated PPO run, on the machine's
GPUs, summarised as one JSON object. ``--device cpu`` runs the same checks on the CPU (the test suite does)."""
