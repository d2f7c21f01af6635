"""The scheduler's pure core: snapshots and time in, decisions out (see scheduler/core/scheduler.py)."""

from scheduler.core.admission import AdmissionConfig
from scheduler.core.cost_model import CostModel, WorkerProfile
from scheduler.core.placement import DisaggregationRule
from scheduler.core.scheduler import Scheduler, SchedulerConfig

__all__ = [
    "AdmissionConfig",
    "CostModel",
    "DisaggregationRule",
    "Scheduler",
    "SchedulerConfig",
    "WorkerProfile",
]
