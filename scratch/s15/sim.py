"""Offline model of the slot engine on session 14's trace: how much of its 25.5 s the step and insert costs explain."""
import sys
import numpy as np
sys.path.insert(0, ".")
from benchmarks.serving import make_trace
trace = make_trace(16.0, 128, (512, 2048), (32, 512), 151000, 151000, 0)
plen = np.array([len(r.prompt) for r in trace]); out = np.array([r.output for r in trace]); arr = np.array([r.arrival for r in trace])
bl, slots = 4, 16
blocks = -(-(plen + out) // bl) - plen // bl
tokens = out.sum()
def simulate(step_s, insert_total_s, overlap=True):
    ins = insert_total_s * plen / plen.sum()
    t, queue, nxt, left, busy = 0.0, [], 0, [0] * slots, [None] * slots
    done, steps, idle = 0, 0, 0.0
    freed = []
    while done < len(trace):
        while nxt < len(trace) and arr[nxt] <= t:
            queue.append(nxt); nxt += 1
        for s in freed:  # overlap: freed a step late
            busy[s] = None
        freed = []
        for s in range(slots):
            if busy[s] is None and queue:
                i = queue.pop(0); busy[s] = i; left[s] = blocks[i]; t += ins[i]
        if all(b is None for b in busy):
            if nxt < len(trace):
                idle += arr[nxt] - t; t = arr[nxt]; continue
        t += step_s; steps += 1
        for s in range(slots):
            if busy[s] is not None:
                left[s] -= 1
                if left[s] == 0:
                    done += 1
                    if overlap: freed.append(s)
                    else: busy[s] = None
    return t, steps, idle
for step_ms in (24.5, 27.0):
    t, steps, idle = simulate(step_ms / 1e3, 5.6)
    print(f"step {step_ms} ms: makespan {t:.1f} s, {steps} steps, tokens/s {tokens / t:.0f} (vs lockstep 1047.1: {tokens / t / 1047.1:.2f}x), idle waiting for arrivals {idle:.2f} s")
print("tokens", tokens, "last arrival", round(arr[-1], 2))
