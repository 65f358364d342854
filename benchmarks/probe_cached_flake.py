"""Runs test_gpu_cached_equals_device_after_replacements[63] over many seeds on the GPU and counts
the failing assertions (the GPU suite of session 6 failed it in 2 of 5 runs).

    PYTHONPATH=src python benchmarks/probe_cached_flake.py 200
"""
import sys, traceback, collections
sys.path.insert(0, "tests")
import torch
import test_cached_placement as t
failures = collections.Counter()
examples = {}
for seed in range(int(sys.argv[1])):
    try:
        t.test_gpu_cached_equals_device_after_replacements(63, seed)
    except AssertionError as error:
        message = str(error).splitlines()[0][:160]
        line = traceback.extract_tb(error.__traceback__)[-1].lineno
        failures[(line, message)] += 1
        examples.setdefault((line, message), seed)
print(f"{sum(failures.values())} of {sys.argv[1]} seeds failed")
for key, count in failures.most_common():
    print(count, "line", key[0], key[1], "first seed", examples[key])
