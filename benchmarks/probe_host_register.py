"""Small host tables registered side by side (GPU), packed into heap memory as the host placement
packs separate value / scale tensors (``pack_rows``' own buffer): prints how many registrations
CUDA refused and why. Session 6 checked with it whether ``cudaHostRegister`` refuses ranges that
share a page (a guess at a flaky cached-placement GPU test): 40 of 40 registered on the H200
(driver 580.159), so that guess was dropped.

    PYTHONPATH=src python benchmarks/probe_host_register.py [--tables 40]
"""

from __future__ import annotations

import argparse
import collections

import torch

from engram.table.host_rows import pack_rows, register_with_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=40)
    options = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    torch.cuda.init()
    for name, pack in (("heap", pack_rows),):
        kept, releases, outcomes = [], [], collections.Counter()
        for _ in range(options.tables):
            rows = int(torch.randint(1, 400, (1,), generator=generator))
            values = torch.randint(0, 255, (rows, 64), dtype=torch.uint8, generator=generator)
            scales = torch.randint(100, 140, (rows, 2), dtype=torch.uint8, generator=generator)
            packed = pack(values, scales)
            kept.append(packed)
            try:
                releases.append(register_with_cuda(packed.packed))
                outcomes["registered"] += 1
            except RuntimeError as error:
                outcomes[str(error).split("CUDA error ")[-1][:80]] += 1
        print(f"{name:10s} {dict(outcomes)}")
        for release in releases:
            release()


if __name__ == "__main__":
    main()
