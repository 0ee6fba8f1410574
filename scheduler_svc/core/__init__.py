"""The scheduler's decision core: plain objects, no network (see scheduler.py)."""

from scheduler_svc.core.config import ConfigError, SchedulerConfig
from scheduler_svc.core.in_flight import WorkerOutputError
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.stats import SchedulerStats

__all__ = ["ConfigError", "Request", "RequestStatus", "Scheduler", "SchedulerConfig",
           "SchedulerStats", "WorkerOutputError"]
