"""`elflow push`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import sys

from elflow.lifecycle.outputs import check_out
from elflow.lifecycle.push import CARD_SAMPLES, push
from elflow.util.budget import check_count
from elflow.util.devices import check_device


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="an elflow run folder or checkpoint folder")
    p.add_argument("hub_id", metavar="HUB_ID", help="the Hub model repository, owner/name (created if needed)")
    p.add_argument("--private", action="store_true", help="create the repository private (default: public)")
    p.add_argument("--revision", default=None, help="the branch to upload to, created if needed (default: main)")
    p.add_argument("--dry-run", action="store_true",
                   help="upload nothing: write the folder that would be uploaded to --out")
    p.add_argument("--out", default=None, help="a new folder to write the uploaded files to (needed with --dry-run; "
                                               "default: a temporary folder)")
    p.add_argument("--samples", type=int, default=CARD_SAMPLES, help="samples shown in the model card (0: none)")
    p.add_argument("--message", default=None, help="the commit message (default: elflow push of RUN)")
    p.add_argument("--device", default=None, help="where the card's samples are drawn (default: cuda when available)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    check_count(args.samples, "--samples", 1_000, "a model card shows a few samples", 0)
    if args.out is not None:
        check_out(args.out, folder=True)  # the output rules, a run's folder included, before any work
    res = push(args.checkpoint, args.hub_id, private=args.private, revision=args.revision, out=args.out,
               dry_run=args.dry_run, num_samples=args.samples, device=check_device(args.device),
               progress=not args.quiet, commit_message=args.message)
    if args.dry_run:
        print(f"wrote {res['folder']} ({', '.join(res['files'])}); nothing was uploaded")
    else:
        print(f"uploaded {', '.join(res['files'])} to {args.hub_id}: {res['url']}", file=sys.stderr)
    return 0
