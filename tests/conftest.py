"""Shared fixtures: one local Ray for the session; test workers shipped to it by value."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray with 16 logical CPU slots; test worker classes are pickled by value."""
    import ray
    import ray.cloudpickle

    import tests
    from hybridflow_lab.controller import init_cluster, shutdown_cluster

    ray.cloudpickle.register_pickle_by_value(tests)  # and its submodules: the test worker classes
    init_cluster(num_cpus=16, log_to_driver=False)
    yield ray
    shutdown_cluster()


@pytest.fixture(params=["local", "ray"])
def backend(request):
    """Run a test on both backends; the ray one gets the session cluster."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param
