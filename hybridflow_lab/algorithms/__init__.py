"""RLHF algorithms as pure torch functions: advantages, losses, KL (this package imports only torch)."""
