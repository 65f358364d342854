"""Small host tables registered side by side (GPU), packed into heap memory (``pack_rows``' own
buffer) and into pages of their own (``pack_rows_in_own_pages``, what the host placement does).
Per packing: how many buffers already looked pinned before registration (a page shared with a
table registered before them: ``register_with_cuda`` would then leave them unregistered) and how
many registrations CUDA refused. Session 6, H200 (driver 580.159), heap packing: 40 of 40
registered without an error (the pinned-before count was not yet printed then).

    PYTHONPATH=src python benchmarks/probe_host_register.py [--tables 40]
"""

from __future__ import annotations

import argparse
import collections

import torch

from engram.table.host_memory.rows import pack_rows, pack_rows_in_own_pages, register_with_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=40)
    options = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    torch.cuda.init()
    for name, pack in (("heap", pack_rows), ("own pages", pack_rows_in_own_pages)):
        kept, releases, outcomes = [], [], collections.Counter()
        for _ in range(options.tables):
            rows = int(torch.randint(1, 400, (1,), generator=generator))
            values = torch.randint(0, 255, (rows, 64), dtype=torch.uint8, generator=generator)
            scales = torch.randint(100, 140, (rows, 2), dtype=torch.uint8, generator=generator)
            packed = pack(values, scales)
            kept.append(packed)
            if packed.packed.is_pinned():
                outcomes["looked pinned before registration"] += 1
            try:
                releases.append(register_with_cuda(packed.packed))
                outcomes["registered (or left alone)"] += 1
            except RuntimeError as error:
                outcomes[str(error).split("CUDA error ")[-1][:80]] += 1
        print(f"{name:10s} {dict(outcomes)}")
        for release in releases:
            release()


if __name__ == "__main__":
    main()
