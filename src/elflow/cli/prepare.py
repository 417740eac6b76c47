"""`elflow prepare`: its flags and its run (the work is the library's)."""

from __future__ import annotations

from elflow.data.ingest import prepare_store
from elflow.data.layout import LAYOUTS, PACKED
from elflow.data.workers import check_workers
from elflow.lifecycle.outputs import check_out
from elflow.space import build_space, tokenizer_spec
from elflow.util.errors import ELFError


def add_arguments(p) -> None:
    p.add_argument("source", metavar="SOURCE",
                   help="a .txt file (one document), a folder of .txt files, a .jsonl file, 'builtin', a hub dataset "
                        "name (streamed, e.g. openwebtext; name:config for a configuration), or the authors' "
                        "pre-tokenized sets (embedded-language-flows/openwebtext-t5, a save_to_disk folder) with "
                        "--space t5-small")
    p.add_argument("--space", required=True,
                   help="the embedding space whose tokenizer the store holds ids of, as `elflow train --space` takes "
                        "it (minilm, t5-small, t5:FOLDER, random-table:minilm, ...); only its tokenizer is loaded")
    p.add_argument("--out", required=True, help="the store folder to write")
    p.add_argument("--layout", choices=LAYOUTS, default=PACKED,
                   help="the text layout recorded as the store's own (a text store serves both) (default: packed)")
    p.add_argument("--source-length", type=int, default=None, metavar="S",
                   help="read (source, target) pairs instead of documents, for conditional training with "
                        "--source-length S; sources are kept whole and cut to S when rows are read "
                        "(default: documents)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizing processes, at most the available CPU cores (default: all of them, one for a "
                        "source of a few MB)")
    p.add_argument("--field", default="text", help="the text field of .jsonl / hub records (default: text)")
    p.add_argument("--source-field", default="input", help="the source field of pair records (default: input)")
    p.add_argument("--target-field", default="output", help="the target field of pair records (default: output)")
    p.add_argument("--on-bad", choices=("stop", "skip"), default="stop",
                   help="empty, binary or non-UTF-8 files and bad jsonl lines: stop with an error, or skip them with "
                        "a warning (default: stop)")
    p.add_argument("--split", default="train", help="the split of a hub or saved dataset (default: train)")
    p.add_argument("--max-documents", type=int, default=None,
                   help="read at most this many documents or pairs (default: all)")
    p.add_argument("--hash", action="store_true",
                   help="kept for earlier scripts: the sha256 of each source file is now always recorded in the "
                        "manifest, taken while the file is read for tokenizing")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the store in --out (only a store's own files; other files stay)")
    p.add_argument("--cache-dir", default=None,
                   help="where the built-in corpus is cached (default: $ELFLOW_CACHE or ~/.cache/elflow)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is one only when stderr is a terminal)")


def run(args) -> int:
    if args.workers is not None:
        check_workers(args.workers)
    if args.max_documents is not None and args.max_documents < 1:
        raise ELFError(f"--max-documents must be at least 1, got {args.max_documents}")
    if args.source_length is not None and args.source_length < 1:
        raise ELFError(f"--source-length must be at least 1, got {args.source_length}")
    out = check_out(args.out, folder=True)
    space = build_space(tokenizer_spec(args.space))
    pairs = args.source_length is not None
    store = prepare_store(args.source, space, out, pairs=pairs, layout=args.layout, source_length=args.source_length,
                          field=args.field, source_field=args.source_field, target_field=args.target_field,
                          on_bad=args.on_bad, split=args.split, max_documents=args.max_documents,
                          workers=args.workers, overwrite=args.overwrite,
                          progress=False if args.quiet else None, cache_dir=args.cache_dir, space_name=args.space)
    m = store.manifest
    size = sum(m["bytes"].values())
    what = ("pair" if pairs else "document") + ("" if store.count == 1 else "s")
    print(f"prepared {out}: {store.count:,} {what}, {store.num_tokens:,} tokens ({m['dtype']}, "
          f"{size / max(store.num_tokens, 1):.2f} bytes per token, {size / 2**20:,.1f} MiB) in "
          f"{m['build']['seconds']:.1f} s on {m['build']['workers']} worker(s)")
    flags = f"--source-length {args.source_length}" if pairs else f"--layout {args.layout}"
    print(f"train on it with: elflow train --data {out} --space {args.space} {flags} ...")
    return 0
