"""The single controller and its worker groups: the paper's hierarchical programming model."""

from hybridflow_lab.controller.cluster import init_cluster
from hybridflow_lab.controller.decorator import Execute, register
from hybridflow_lab.controller.dispatch import Dispatch, DispatchMode, Split, register_dispatch_mode
from hybridflow_lab.controller.errors import WorkerCallError, WorkerCallTimeout, WorkerGroupClosed
from hybridflow_lab.controller.futures import DataBatchFuture
from hybridflow_lab.controller.host import Role
from hybridflow_lab.controller.mesh import GroupLayout, Mesh
from hybridflow_lab.controller.resource_pool import ResourcePool
from hybridflow_lab.controller.worker import Worker
from hybridflow_lab.controller.worker_group import WorkerGroup, live_groups, shutdown_all, shutdown_cluster

__all__ = [
    "DataBatchFuture", "Dispatch", "DispatchMode", "Execute", "GroupLayout", "Mesh", "ResourcePool", "Role",
    "Split", "Worker", "WorkerCallError", "WorkerCallTimeout", "WorkerGroup", "WorkerGroupClosed", "init_cluster",
    "live_groups", "register", "register_dispatch_mode", "shutdown_all", "shutdown_cluster",
]
