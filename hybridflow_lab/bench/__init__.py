"""Benchmarks behind `hybridflow-lab bench ...`; each returns one JSON-ready dict."""
