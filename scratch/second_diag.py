"""Where a second process's seconds go: every JAX duration event with its time since start."""
import time; start = time.perf_counter()
import collections, json, sys
import jax
events = collections.defaultdict(lambda: [0, 0.0])
log = []
def dur(event, secs, **kw):
    events[event][0] += 1; events[event][1] += secs
    if secs > 0.05:
        log.append((round(time.perf_counter() - start, 2), event, round(secs, 3)))
jax.monitoring.register_event_duration_secs_listener(dur)
from benchmarks.compile_once import build, call
t0 = time.perf_counter()
model, ids, options = build(sys.argv[1], tiny=sys.argv[2] == "tiny")
built = time.perf_counter()
out = call(model, ids, options)
done = time.perf_counter()
t1 = time.perf_counter(); out = call(model, ids, options); warm = time.perf_counter() - t1
print("import_s", round(t0 - start, 2), "build_s", round(built - t0, 2), "generate_s", round(done - built, 2), "warm_s", round(warm, 2))
for k, (n, s) in sorted(events.items(), key=lambda kv: -kv[1][1]):
    print(f"{s:8.3f} s {n:5d}  {k}")
for row in log:
    print(row)
