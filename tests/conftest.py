"""Shared fixtures: one local Ray for the session; test workers shipped to it by value. Tests that start Ray carry
the ``ray`` mark (checked here), so that ``-m "not ray"`` runs exactly the part of the suite that needs no cluster."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist's workers share the machine's cores: each test process, and every process it starts (a notebook
    # kernel, a CLI run, a Ray rank), gets its share of threads. Two workers of two OpenMP threads each on two cores
    # slowed each other several-fold (the notebooks' pass stalled past 15 minutes against 6 run one at a time).
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(share)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test that asks for the session's Ray without the ``ray`` mark; run the notebooks first (long units
    of work for pytest-xdist to start early), then the tests without Ray, then the modules that start Ray, so that
    in one process a test without the mark finds no Ray running to lean on."""
    unmarked = [item.nodeid for item in items
                if "ray_cluster" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("ray")]
    if unmarked:
        raise pytest.UsageError("these tests use the ray_cluster fixture without @pytest.mark.ray:\n  "
                                + "\n  ".join(unmarked))
    with_ray = {item.path for item in items if item.get_closest_marker("ray")}
    items.sort(key=lambda item: (item.path.suffix != ".ipynb", item.path in with_ray))  # stable: in order within


@pytest.fixture(autouse=True)
def ray_only_with_its_mark(request: pytest.FixtureRequest):
    """A test without the ``ray`` mark fails if Ray starts while it runs, in this process or in one it starts: Ray
    puts each new session under ``$RAY_TMPDIR/ray``, pointed here at a directory of this test's own."""
    if request.node.get_closest_marker("ray"):
        yield
        return
    scratch = Path(tempfile.mkdtemp(prefix="noray-", dir="/tmp"))  # short: Ray's socket paths must stay short
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_TMPDIR", str(scratch))
            yield
        started = (scratch / "ray").exists()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if started:
        pytest.fail("this test started Ray without the `ray` mark: add @pytest.mark.ray (pyproject.toml's markers)")


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``tiny_models(seed, size="tiny", arch="qwen2")``: a model directory of ``size`` and architecture ``arch`` built
    from ``seed`` (with the character tokenizer), made once per session and shared by the modules that ask for it."""
    from hybridflow_lab.models import create_model_dir

    made: dict[tuple[str, int, str], str] = {}

    def model(seed: int, size: str = "tiny", arch: str = "qwen2") -> str:
        if (size, seed, arch) not in made:
            path = tmp_path_factory.mktemp(f"{arch}-{size}-seed{seed}") / "m"
            made[(size, seed, arch)] = str(create_model_dir(path, size, arch, seed=seed))
        return made[(size, seed, arch)]

    return model


@pytest.fixture(scope="module")
def model_dir(request, tiny_models):
    """The test module's model: its ``MODEL_SIZE`` (default tiny) and ``MODEL_ARCH`` (default qwen2) built from its
    ``MODEL_SEED`` (default 11)."""
    return tiny_models(getattr(request.module, "MODEL_SEED", 11), getattr(request.module, "MODEL_SIZE", "tiny"),
                       getattr(request.module, "MODEL_ARCH", "qwen2"))


@pytest.fixture(params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def backend(request):
    """Run a test on both backends; the ray one gets the session cluster."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param
