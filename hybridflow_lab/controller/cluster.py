"""Start or join the Ray cluster that worker groups run on."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from hybridflow_lab.exposure import LOOPBACK, ExposureRefused, checked_bind_address, is_loopback

ADDRESS_ENV = "HYBRIDFLOW_RAY_ADDRESS"
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # Ray's switch for token authentication: "token" (a local default) or "disabled"
NAMESPACE = "hybridflow_lab"
BREAKPOINT_ENV = "PYTHONBREAKPOINT"
# Ray's default debugger (RAY_DEBUG=1, debugpy) opens a breakpoint() in a worker on the node's address, without
# authentication; "legacy" is Ray's pdb over a socket on 127.0.0.1, which `ray debug` attaches to from the node
DEBUGGER_ENV, LOOPBACK_DEBUGGER = "RAY_DEBUG", "legacy"
# Ray runs its workers at nice 15, behind its own daemons; here they are the run's ranks, and beside any process at
# nice 0 (the notebook kernel, a second pytest worker) they got a few percent of a core: a 16 s test took 300 s.
# Ray's job submission runs its drivers at 0 the same way.
NICENESS_ENV, RANK_NICENESS = "RAY_worker_niceness", "0"

logger = logging.getLogger(__name__)


def default_cpu_slots() -> int:
    """Logical CPU slots for a local Ray, oversubscribed so that several pools fit on a small machine.

    A slot is a scheduling token, not a core: ranks share the cores and run one thread each.
    """
    return max(32, 16 * (os.cpu_count() or 1))


def init_cluster(address: str | None = None, num_cpus: int | None = None, expose_dashboard: bool = False,
                 log_file: str | os.PathLike[str] | None = None, **ray_init: Any) -> dict[str, float]:
    """Connect this controller to Ray and return the cluster's resources.

    With no ``address`` (and no ``HYBRIDFLOW_RAY_ADDRESS``) a local Ray starts with
    ``num_cpus`` logical CPU slots; with an address (``"auto"``, ``"ray://host:10001"``)
    the controller joins that cluster: the multi-node path. A second call is a no-op.
    A local Ray keeps its token authentication on; its dashboard is off unless ``include_dashboard=True``, and
    listens on 127.0.0.1 unless ``expose_dashboard`` allows another ``dashboard_host``. A ``breakpoint()`` in a
    worker opens Ray's debugger on 127.0.0.1 (``ray debug`` on that node attaches), not on the node's address,
    unless ``RAY_DEBUG`` is set. A local Ray's ranks run at the controller's priority (Ray's default is nice 15),
    unless ``RAY_worker_niceness`` is set. With ``log_file``, Ray's own start-up lines (its banner, the
    token-authentication note) are appended there instead of printed (a notebook cell shows only the run's output).
    """
    if not ray.is_initialized():
        with ray_log_to(log_file), controller_breakpoints_kept():
            _start(address, num_cpus, expose_dashboard, ray_init)
    return ray.cluster_resources()


@contextmanager
def controller_breakpoints_kept() -> Iterator[None]:
    """Keep this process's ``PYTHONBREAKPOINT`` through ``ray.init``.

    ``ray.init`` points the driver's ``breakpoint()`` at Ray's debugger, which (with Ray's default ``RAY_DEBUG=1``)
    listens for an IDE and blocks until one attaches. The driver here is the controller, usually a notebook
    kernel, where a ``breakpoint()`` in a cell or in a local-backend worker must open pdb in the notebook. Ray's
    worker processes set their own hook and keep Ray's debugger.
    """
    saved = os.environ.get(BREAKPOINT_ENV)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(BREAKPOINT_ENV, None)
        else:
            os.environ[BREAKPOINT_ENV] = saved


def _start(address: str | None, num_cpus: int | None, expose_dashboard: bool, ray_init: dict[str, Any]) -> None:
    address = address or os.environ.get(ADDRESS_ENV)
    options: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False, **ray_init}
    if address:  # the cluster's own dashboard and authentication settings apply
        ray.init(address=address, **{**options, "runtime_env": with_worker_debugger(options.get("runtime_env"))})
    else:
        # a local Ray's processes inherit this environment: no runtime_env, which costs each group about 0.8 s
        os.environ.setdefault(DEBUGGER_ENV, LOOPBACK_DEBUGGER)
        os.environ.setdefault(NICENESS_ENV, RANK_NICENESS)
        warn_if_auth_disabled()
        options["dashboard_host"] = dashboard_host(options.get("dashboard_host", LOOPBACK), expose_dashboard)
        # "local": never join a cluster that Ray's address file names (one started earlier, maybe long dead)
        ray.init(address="local", num_cpus=num_cpus or default_cpu_slots(), **options)


def with_worker_debugger(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """``runtime_env`` (this job's workers' environment on a cluster joined by address) with Ray's debugger on
    loopback: the controller's ``RAY_DEBUG`` when the user set one, else ``legacy``."""
    env = dict(runtime_env or {})
    env["env_vars"] = {DEBUGGER_ENV: os.environ.get(DEBUGGER_ENV, LOOPBACK_DEBUGGER), **env.get("env_vars", {})}
    return env


@contextmanager
def ray_log_to(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """While the body runs, the ``ray`` logger writes to ``path`` (appended) instead of stderr (None: unchanged)."""
    if path is None:
        yield
        return
    ray_logger = logging.getLogger("ray")
    saved, handler = list(ray_logger.handlers), logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))
    ray_logger.handlers = [handler]
    try:
        yield
    finally:
        ray_logger.handlers = saved
        handler.close()


def dashboard_host(host: str, expose: bool = False) -> str:
    """Where a local Ray's dashboard may listen: ``host`` if it is loopback, or if ``expose`` allows it and
    token authentication is on (the dashboard accepts jobs, so without a token it would run anyone's code)."""
    if auth_disabled() and not is_loopback(host):
        raise ExposureRefused(f"refusing to expose the Ray dashboard on {host} while {AUTH_MODE_ENV}=disabled; "
                              "unset it to keep token authentication on")
    return checked_bind_address(host, expose, "the Ray dashboard", "expose_dashboard=True")


def auth_disabled() -> bool:
    """Whether the environment turns Ray's token authentication off (it is on by default for a local Ray)."""
    return os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled"


def warn_if_auth_disabled() -> None:
    """Log a warning naming the risk when the environment turns token authentication off."""
    if auth_disabled():
        logger.warning("%s=disabled: Ray's token authentication is off, so anyone who can reach this machine's "
                       "Ray ports can run code in the cluster; unset it to turn authentication back on",
                       AUTH_MODE_ENV)


def alive_actors() -> list[str]:
    """Class names of the live Ray actors in the cluster (to check that nothing leaked)."""
    if not ray.is_initialized():
        return []
    from ray._private import state  # the public state API needs the dashboard, which we do not start

    return sorted(a["ActorClassName"] for a in state.actors().values() if a["State"] == "ALIVE")
