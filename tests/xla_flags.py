"""XLA flags of the test processes: conftest sets them for the session, and tests that start
their own processes with another simulated device count build theirs here, so every process
compiles the same way (see conftest for why LLVM's optimisation is off)."""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
