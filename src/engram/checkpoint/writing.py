"""Write Engram tensors in the checkpoint's safetensors layout (docs/design.md §2 "Checkpoint tensors"):
one or more shards and, for several, ``model.safetensors.index.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file

from engram.checks import check_positive_int
from engram.table.fp8 import E8M0_DTYPE
from engram.checkpoint.reading import INDEX_FILE, engram_tensor_name

__all__ = ["EngramLayerTensors", "write_engram_checkpoint"]


@dataclass
class EngramLayerTensors:
    """All checkpoint tensors of one layer, to write.

    ``embed_weight`` ``float8_e4m3fn [rows, head_dim]``; ``embed_scale`` UE8M0 ``uint8`` or
    ``float8_e8m0fnu`` ``[rows, head_dim / 32]``; ``wkv_weight`` ``float8_e4m3fn`` (with
    ``wkv_scale`` UE8M0 ``[ceil(out/br), ceil(in/bc)]``) or bf16 (``wkv_scale`` None);
    ``q_weight``, ``k_weight`` bf16 ``[hc, hidden]``.
    """

    embed_weight: torch.Tensor
    embed_scale: torch.Tensor
    wkv_weight: torch.Tensor
    wkv_scale: torch.Tensor | None
    q_weight: torch.Tensor
    k_weight: torch.Tensor

    def named(self, layer_id: int, prefix: str = "") -> dict[str, torch.Tensor]:
        """Checkpoint name -> tensor as stored (UE8M0 bytes as ``float8_e8m0fnu`` where torch has it)."""
        tensors = {"embed.weight": self.embed_weight, "embed.scale": _as_ue8m0(self.embed_scale),
                   "wkv.weight": self.wkv_weight, "q_weight": self.q_weight, "k_weight": self.k_weight}
        if self.wkv_scale is not None:
            tensors["wkv.scale"] = _as_ue8m0(self.wkv_scale)
        return {engram_tensor_name(layer_id, kind, prefix): tensor.contiguous().cpu() for kind, tensor in tensors.items()}


def _as_ue8m0(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.uint8 and E8M0_DTYPE is not None:
        return tensor.view(E8M0_DTYPE)
    return tensor


def _split_by_bytes(named: Mapping[str, torch.Tensor], num_shards: int) -> list[dict[str, torch.Tensor]]:
    """``num_shards`` groups of about equal bytes: largest tensor first, each into the lightest
    group so far (ties: the first group); every group gets a tensor when there are enough."""
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in named.items()}
    totals = [0] * num_shards
    owner: dict[str, int] = {}
    for name in sorted(named, key=lambda n: -sizes[n]):
        lightest = min(range(num_shards), key=lambda k: (totals[k], k))
        owner[name] = lightest
        totals[lightest] += sizes[name]
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for name, tensor in named.items():  # each file keeps the tensors in their given order
        groups[owner[name]][name] = tensor
    return groups


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_engram_checkpoint(
    directory: str | os.PathLike,
    layers: Mapping[int, EngramLayerTensors],
    *,
    num_shards: int = 1,
    with_index: bool = True,
    prefix: str = "",
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, str]:
    """Write the layers' tensors as safetensors shards; returns the weight map (name -> file name).

    Tensors are split by bytes into ``num_shards`` files ``model-0000k-of-0000n.safetensors``
    (``model.safetensors`` for one shard without index): largest first, each into the
    file holding the fewest bytes so far (so the tables land in different files, and
    one layer's tensors spread over several). With ``with_index`` also
    ``model.safetensors.index.json``. Files get the permissions of the process umask,
    as any file the process creates. Meant for tests, demos and converted tables of
    moderate size (each file is built in memory).
    """
    check_positive_int("num_shards", num_shards)
    named: dict[str, torch.Tensor] = {}
    for layer_id, tensors in layers.items():
        named.update(tensors.named(layer_id, prefix))
    for name, tensor in (extra_tensors or {}).items():
        if name in named:
            raise ValueError(f"extra_tensors: {name!r} clashes with an Engram tensor name")
        named[name] = tensor.contiguous().cpu()
    if num_shards > len(named):
        raise ValueError(f"num_shards: expected at most {len(named)} (one tensor per file at least), found {num_shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if num_shards == 1 and not with_index:
        file_names = ["model.safetensors"]
    else:
        file_names = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
    groups = _split_by_bytes(named, num_shards)
    mode = 0o666 & ~_current_umask()
    weight_map: dict[str, str] = {}
    for file_name, group in zip(file_names, groups):
        temporary = directory / (file_name + ".tmp")
        try:
            save_file(group, str(temporary), metadata={"format": "pt"})
            os.chmod(temporary, mode)  # safetensors creates its files 0600
            os.replace(temporary, directory / file_name)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        weight_map.update({name: file_name for name in group})
    if with_index:
        total = sum(t.numel() * t.element_size() for t in named.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return weight_map
