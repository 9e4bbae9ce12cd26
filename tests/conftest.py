import os

from hypothesis import HealthCheck, settings

# CI: bounded and derandomized, so the suite is fast and a failure replays. `thorough`: many more.
settings.register_profile(
    "ci",
    max_examples=25,
    stateful_step_count=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, stateful_step_count=8, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# In worker processes (pytest-xdist, as scripts/test.sh runs the suite) the cores are shared among the workers: each
# takes its share of torch's threads, so they do not oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # as nproc
    torch.set_num_threads(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
