"""CUDA-event timing shared by the probes in this folder (each run as a script, so this folder is
on the import path)."""
import torch


def median_ms(fn, reps=30, warmup=5, before=None):
    """Median time of `fn` in ms over `reps` calls after `warmup` untimed ones, each call timed
    alone by CUDA events; `before`, when given, runs ahead of every timed call, outside its
    events (e.g. to set the L2's state)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
