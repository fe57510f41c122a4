"""CUDA-event timing shared by the probes in this folder (each run as a script, so this folder is
on the import path): `trimul.bench`'s, so the trimul package must be installed."""
from trimul.bench import timed


def median_ms(fn, reps=30, warmup=5, before=None):
    """Median time of `fn` in ms over `reps` calls after `warmup` untimed ones, each call timed
    alone by CUDA events; `before`, when given, runs ahead of every timed call, outside its
    events (e.g. to set the L2's state)."""
    times = sorted(timed(fn, reps, warmup, before))
    return times[len(times) // 2]
