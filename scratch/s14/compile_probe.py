"""pytest plugin (-p compile_probe): seconds of JAX tracing / lowering / backend compile per test file."""
import collections
import jax

TOTALS = collections.defaultdict(collections.Counter)
CURRENT = ["?"]


def listener(event, duration, **kwargs):
    TOTALS[CURRENT[0]][event.rsplit("/", 1)[-1]] += duration
    TOTALS[CURRENT[0]]["n_" + event.rsplit("/", 1)[-1]] += 1


jax.monitoring.register_event_duration_secs_listener(listener)


def pytest_runtest_setup(item):
    CURRENT[0] = item.path.name


def pytest_sessionfinish(session):
    with open("/tmp/compile_probe.txt", "a") as f:
        for name, c in sorted(TOTALS.items()):
            f.write(f"{name} " + " ".join(f"{k}={v:.1f}" for k, v in sorted(c.items())) + "\n")
