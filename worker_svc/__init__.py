# Before anything here loads torch: libgomp reads its wait policy once, when it loads.
from worker_svc import cpu_threads as _cpu_threads

_cpu_threads.apply_wait_policy()
