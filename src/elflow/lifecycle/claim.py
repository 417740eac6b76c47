"""The run folder's rules, as the trainer applies them: the hold on it (lock, clean-up of interrupted saves,
the run that --overwrite replaces, set aside until the new run's first checkpoint), what --resume and
--overwrite may do with it, the checkpoint a resume continues from, the micro-batch over a new number of
ranks, and the check that every node of a multi-node run sees the same folder."""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from dataclasses import fields, replace
from pathlib import Path

from elflow.config import TrainConfig, mutable_flags, resume_conflicts
from elflow.data.corpus import BUILTIN_NAMES
from elflow.lifecycle.stages import in_first_stage
from elflow.runs.checkpoint import (
    foreign_in_checkpoints,
    holds_set_aside,
    list_checkpoints,
    newest_usable,
    recover_replaced,
    remove_stale_temporaries,
    restore_aside,
    set_aside,
)
from elflow.runs.folder import (
    CHECKPOINTS,
    DECODER_STAGE,
    EARLIER_RUN,
    LOSS_PLOT,
    METRICS_FILE,
    REPLACED,
    REPORT_FILE,
    RUN_FILE,
    RUN_FILES,
    SAMPLES_FILE,
    TENSORBOARD,
    WANDB_FOLDER,
    run_folders_holding,
    step_of,
)
from elflow.runs.load import checkpoint_record
from elflow.runs.record import differences
from elflow.runs.stored import run_file
from elflow.runs.tracking import ID_FILE
from elflow.space import SpaceSpec
from elflow.util.errors import ELFError
from elflow.util.files import (
    FolderHold,
    FolderLock,
    NoSpace,
    atomic_write_json,
    atomic_write_text,
    check_output,
    check_own,
    probe_writable,
    read_json,
    resolved,
)
from elflow.util.jsonio import RECORD_BYTES, read_limited


class RunFolder:
    """Rank 0's hold on the run folder (`FolderHold`: made, locked, the folders it made removed after a
    failure), the clean-up of interrupted saves and replacements, and the run being replaced, which is set
    aside and comes back if the new run fails before its first checkpoint."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = out, command
        self.hold = FolderHold(out, command)
        self.aside = out / REPLACED
        self.fresh = False  # a new run in a folder that held none: what it wrote goes if it fails before saving

    @property
    def lock(self):
        return self.hold.lock

    def open(self) -> None:
        self.hold.open()
        self.recover()
        for p in remove_stale_temporaries(self.out):
            print(f"removed {p}, left by a save that was interrupted", file=sys.stderr)

    def recover(self) -> None:
        """A replacement interrupted before the new run's first checkpoint: the old run comes back; so does the
        run.json a resume rewrote before it was stopped short of its first checkpoint."""
        if recover_replaced(self.out, lambda d: bool(list_checkpoints(d))) == "restored":
            print(f"restored the run in {self.out} that an interrupted --overwrite was replacing", file=sys.stderr)
        if recover_earlier_run(self.out):
            print(f"restored {self.out / RUN_FILE} as it was before a resume that stopped before its first "
                  "checkpoint rewrote it", file=sys.stderr)

    def keep_earlier_run(self, step: int) -> None:
        """Before a resume from checkpoint `step` rewrites run.json: its bytes kept beside it, with the step,
        until the resume's first checkpoint lands (`commit`)."""
        keep_earlier_run(self.out, step)

    def set_aside(self) -> None:
        """Move the run's own files (never other files) out of the way of the new run."""
        set_aside(self.out)

    def commit(self) -> None:
        """The new run has a checkpoint: the replaced run, and run.json as it was before a resume, are dropped."""
        if holds_set_aside(self.out):
            shutil.rmtree(self.aside)
        self.drop_earlier_run()

    def drop_earlier_run(self) -> None:
        """run.json as it was before a resume goes: the resume's own run.json stands."""
        if os.path.lexists(self.out / EARLIER_RUN):
            os.unlink(self.out / EARLIER_RUN)

    def close(self, ok: bool) -> None:
        if self.hold.lock is None:  # the folder was never ours (another command holds it)
            return
        try:
            if not ok:
                recover_earlier_run(self.out)
            else:  # a resume that ended well (even without a new checkpoint)
                self.drop_earlier_run()
            if not ok and holds_set_aside(self.out):
                restore_aside(self.out)
            elif not ok and self.fresh and not list_checkpoints(self.out):
                remove_run_files(self.out)  # a run that failed before its first checkpoint leaves no run behind
        finally:
            self.hold.close(ok)


def keep_earlier_run(out: Path, step: int) -> None:
    """run.json's bytes and the checkpoint step a resume starts from, written atomically to EARLIER_RUN."""
    text = read_limited(out / RUN_FILE, RECORD_BYTES, own=True).decode("utf-8")
    atomic_write_json(out / EARLIER_RUN, {"step": int(step), "run.json": text})


def recover_earlier_run(out: Path) -> bool:
    """EARLIER_RUN left by a resume that was stopped: where no checkpoint newer than the one it resumed from
    landed, run.json is put back as it was (True); else the resume's own run.json stands and it goes."""
    path = out / EARLIER_RUN
    if not os.path.lexists(path):
        return False
    kept = read_json(path, "run.json as it was before a resume", own=True)
    step, text = kept.get("step"), kept.get("run.json")
    if type(step) is not int or not isinstance(text, str):
        raise ELFError(f"{path}: corrupted (it keeps run.json as it was before a resume, as {{\"step\", "
                       "\"run.json\"}}); restore it, or remove it if run.json describes the newest checkpoint")
    newest = list_checkpoints(out)
    restore = not newest or step_of(newest[-1]) <= step
    if restore:
        atomic_write_text(out / RUN_FILE, text)
    os.unlink(path)
    return restore


def remove_run_files(out: Path) -> None:
    """The files a run writes into its folder (never other files), removed: links and files unlinked, folders
    removed with what they hold."""
    for name in RUN_FILES:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            p.unlink()


def stored_files(out: Path) -> tuple[str, ...]:
    """The names of the run's own files in `out`, as its run.json lists them (all of RUN_FILES when run.json is
    missing or cannot be read: a run whose record was damaged is still replaced as a whole)."""
    try:
        return run_file(out)["files"]
    except ELFError:
        return RUN_FILES


def check_only_own(out: Path, own, whose: str, rule: str) -> None:
    """Refuse a folder `out` that holds anything but `own` (the names of what `whose` wrote) and elflow's own
    bookkeeping (its lock, a run being replaced, a first stage): nothing that a command did not write is ever
    replaced or mixed with a run's files. One line names what is there."""
    if not out.is_dir():
        return
    allowed = {*own, FolderLock.NAME, REPLACED, DECODER_STAGE}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in allowed)
    inner = foreign_in_checkpoints(out) if CHECKPOINTS in own else None
    if foreign or inner is not None:
        where, names = (out, foreign) if foreign else (inner.parent, [inner.name])
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ELFError(f"{where} holds {shown}, which {whose} did not write; {rule} and never removes or mixes with "
                       "other files: move them out of the folder, or choose another --out")


def check_own_files(out: Path) -> None:
    """The run's own files and folders in `out` (those a resume reads or writes) are what elflow wrote: a
    regular file, a real folder (tb/, wandb/). A symbolic link (which would lead the run's writes out of the
    folder), a fifo (a read that never ends) or a device (one that never stops) is one ELFError naming it
    (`check_own`), before any work; checkpoints/ holds checkpoint folders of elflow's files alone (a resume
    prunes them with --keep), and anything else there is one ELFError naming it."""
    for name in (RUN_FILE, METRICS_FILE, LOSS_PLOT, REPORT_FILE, SAMPLES_FILE, ID_FILE):
        check_own(out / name, f"the run's {name}")
    for name in (TENSORBOARD, WANDB_FOLDER):
        check_own(out / name, f"the run's {name}/ folder", folder=True)
    inner = foreign_in_checkpoints(out)
    if inner is not None:
        raise ELFError(f"{inner.parent} holds {inner.name}, which the run did not write; a resume writes and prunes "
                       "(--keep) only its own checkpoints: move it out of the run folder")


def check_run_dir(out: Path, cfg: TrainConfig, resume: bool, overwrite: bool, device=None) -> None:
    """What --resume / --overwrite may do with the folder as it is; the folder is not changed here. `device`:
    where the run resumes (a stored dtype "auto" is read as what it picks there). A new run may not be written
    inside its --init-from run (`check_not_inside`), nor inside any other run's folder."""
    if cfg.init_from and not resume:
        check_not_inside(out, cfg.init_from, "--init-from")
    outer = run_folders_holding(resolved(out).parent)
    if outer:
        raise ELFError(f"--out {out} lies inside {outer[0]}, the folder of another run; a run goes into a folder of "
                       "its own, outside any run (whose `train --overwrite` would take it): choose another --out")
    if not (out / RUN_FILE).exists() and not in_first_stage(out):
        if resume:
            raise ELFError(f"{out} holds no run to resume; check --out, or start the run without --resume")
        check_only_own(out, (), "a run", "a run goes into an empty folder or a folder of its own")
        return
    if overwrite:
        check_only_own(out, stored_files(out), "the run", "--overwrite replaces only what the run wrote")
        return
    if not resume:
        raise ELFError(f"{out} already holds a run; pass --resume to continue it or --overwrite to replace it")
    check_own_files(out)
    diff = resume_conflicts(relocated(stored_config(out), cfg), cfg, device)
    if diff:
        raise ELFError(f"{out} holds a different run ({'; '.join(diff)}); on --resume only "
                       f"{mutable_flags()} may change. Resume it with its "
                       "own settings, or choose another --out")


# ----------------------------------------------------------------------------------------------------------
# the paths a run records: absolute, so that they name the same files from any working folder
PATH_SETTINGS = tuple(f.name for f in fields(TrainConfig) if f.metadata.get("path"))  # (or a hub name)


def local_path(value: str | None) -> str | None:
    """`value` written absolute (os.path.abspath) where it names a local file or folder from here; unchanged
    where nothing of that name is here (a hub name, or a path whose reader will say it is missing) and for the
    built-in corpus's name."""
    if not value or str(value) in BUILTIN_NAMES:
        return value
    path = os.path.expanduser(str(value))
    return os.path.abspath(path) if os.path.lexists(path) else value


def _space_path(space: SpaceSpec | None) -> SpaceSpec | None:
    """The space with the encoder folder it names (its encoder's, or a table's base) written absolute; "minilm"
    and hub ids are names."""
    if space is None or space.name == "minilm" or not os.path.isdir(os.path.expanduser(space.name)):
        return space
    return replace(space, name=os.path.abspath(os.path.expanduser(space.name)))


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with every setting that names a local file or folder (--data, --init-from, --decoder-from, the
    encoder folder of --space) written absolute, as a run records it: a run made in one folder is read the same
    from any other. Hub names, 'builtin' and paths of nothing here stay as they are."""
    return replace(cfg, space=_space_path(cfg.space), **{k: local_path(getattr(cfg, k)) for k in PATH_SETTINGS})


def relocated(stored: TrainConfig, given=None) -> TrainConfig:
    """A stored run's settings as read from here (`absolute_paths`). A run recorded by an earlier elflow may hold
    a path relative to the folder it was trained in, which its record does not hold: where that path names
    same); where it names nothing here, the value `given` (a TrainConfig or a dict of the command line's
    settings) holds for it where that names a local file or folder, as the user's word of where it is now.
    Otherwise it stays relative, and the reader of the setting says so."""
    cfg = absolute_paths(stored)
    get = given.get if isinstance(given, dict) else (lambda k: getattr(given, k, None))
    moved = {}
    for k in PATH_SETTINGS:
        value, now = getattr(cfg, k), local_path(get(k))
        if value and not os.path.isabs(os.path.expanduser(str(value))) and now and os.path.isabs(now):
            moved[k] = now
    return replace(cfg, **moved) if moved else cfg


def stored_config(out: Path) -> TrainConfig:
    """The resolved and checked training config of the run in `out` (of the run an interrupted --overwrite set
    aside, which the next start brings back), from its record. A file that cannot be read, or a setting out of
    range, is a one-line error naming run.json and the setting as it is stored."""
    src = out
    if (out / REPLACED / RUN_FILE).exists() and not list_checkpoints(out):
        src = out / REPLACED
    if in_first_stage(src):  # a --decoder separate run still in its decoder stage: the stage holds its config
        path = src / DECODER_STAGE / RUN_FILE
        return checked(_quietly_read(path.parent)["stage_of"], path)
    path = src / RUN_FILE
    if not path.exists():
        raise ELFError(f"{out} holds no run to resume; check --out, or start the run without --resume")
    run = _quietly_read(src)
    return checked(run["train"], path, run["record"])


def _quietly_read(folder: Path) -> dict:
    """`run_file(folder)` without the warnings of its record (its sampling settings), which are shown where the
    record is used (`claim_run`), after the checks that may refuse it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_file(folder)


def checked(stored: dict | None, path, record=None) -> TrainConfig:
    """Stored training settings, read, resolved and checked: those beside `record` in run.json
    (`TrainConfig.of_run`), or, without a record, a first stage's whole settings (`TrainConfig.stored`);
    ELFError naming `path` and the stored setting."""
    if stored is None:
        raise ELFError(f"{path}: holds no training config (a converted or released model); it cannot be resumed")
    cfg = TrainConfig.stored(stored, path) if record is None else TrainConfig.of_run(record, stored, path)
    try:
        cfg = cfg.resolved()
    except (ValueError, KeyError, TypeError) as e:
        raise ELFError(f"{path}: its config cannot be read ({type(e).__name__}: {e})") from None
    cfg.validate(stored=path)
    return cfg


def no_space(e: BaseException, out: Path) -> ELFError:
    """The one-line error of a full disk while writing the run in `out`, naming its last good checkpoint."""
    good = list_checkpoints(out)
    where = e.path if isinstance(e, NoSpace) else (getattr(e, "filename", None) or out)
    if not good:  # nothing to resume from: a new run's files go with it
        return ELFError(f"no space left on device: {where}; no checkpoint was written, so there is nothing to "
                        "resume: free some space, then run the same command again (without --resume)")
    return ELFError(f"no space left on device: {where}; last good checkpoint: step {step_of(good[-1])}; "
                    "free some space, then run again with --resume")


def resume_point(out: Path, stored: dict | None = None) -> tuple[Path | None, dict | None]:
    """(the checkpoint a --resume continues from, its state.json), chosen before anything is built or read: the
    newest whose state.json reads and whose listed files (its optimiser state too) are regular files of their
    recorded sizes, and whose record is the one of run.json. Their contents are checked as they are loaded, once
    (`load_checkpoint`). (None, None) for a run that saved none yet; ELFError when it saved some and none can
    be resumed, or for a checkpoint of another model than run.json describes (an edited run.json). `stored`:
    run.json as `run_file` read it already (None: read it here)."""
    ckpt, state, bad = newest_usable(out, need_optimizer=True, contents=False)
    if ckpt is None:
        if list_checkpoints(out):
            raise ELFError(f"{out}: no checkpoint can be resumed ({'; '.join(bad)}); nothing was changed. Restore "
                           "the files, or start the run again with --overwrite")
        return None, None
    for why in bad:
        print(f"warning: skipping a bad checkpoint: {why}", file=sys.stderr)
    described = (stored or run_file(out))["record"]
    diff = differences(checkpoint_record(ckpt, state, described).to_dict(), described.to_dict())
    if diff:
        raise ELFError(f"{out / 'run.json'} describes another model than its checkpoint {ckpt.name} holds "
                       f"({'; '.join(diff)}); run.json was edited or replaced: restore it")
    return ckpt, state


def micro_batch_for(cfg: TrainConfig, world: int, stored: dict | None = None) -> int:
    """The rows per forward/backward of `cfg` on `world` ranks: --micro-batch, else the stored run's (on
    --resume: a run's first start resolves it to batch / its ranks; `stored` is its run.json, `run_file`), else batch /
    ranks. A batch it does not split over the ranks is a one-line ELFError that says what to give."""
    kept = (stored["train"] or {}).get("micro_batch") if stored else None
    if cfg.micro_batch or kept:
        micro = cfg.micro_batch or kept
    elif stored and stored.get("world_size"):  # a stored run without a micro-batch: its first start's
        micro = max(1, cfg.batch // int(stored["world_size"]))
    else:
        micro = max(1, cfg.batch // world)
    if cfg.batch % (world * micro) == 0:
        return micro
    shards = cfg.batch // micro
    if stored is None or cfg.batch % micro:
        raise ELFError(f"--batch {cfg.batch} is not divisible by world size {world} x --micro-batch {micro}; "
                       f"choose a batch that is a multiple of {world * micro}")
    ranks = [str(r) for r in range(1, shards + 1) if shards % r == 0]
    smaller = [m for m in range(micro - 1, 0, -1) if cfg.batch % (world * m) == 0]
    other = (f", or give --micro-batch {smaller[0]} to continue with that micro-batch (the rest of the run then "
             "draws other noise than an uninterrupted run)" if smaller else "")
    raise ELFError(f"the run's --batch {cfg.batch} in micro-batches of {micro} rows does not split over {world} "
                   f"ranks: resume it on {' or '.join(ranks)} rank{'s' if ranks != ['1'] else ''} to continue "
                   f"exactly{other}")


SHARED_FOLDER_WAIT = 5.0  # seconds a rank looks for rank 0's lock (a network filesystem's caches lag)


def shared_folder_check(out: Path, lock_text: str, host0: str) -> None:
    """ELFError unless this rank sees the lock rank 0 took in `out` (its text, broadcast): a run folder on
    several nodes must be one folder that every node sees."""
    deadline = time.monotonic() + SHARED_FOLDER_WAIT
    while True:
        try:
            seen = FolderLock.text(out)
        except OSError:
            seen = None
        if seen == lock_text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if seen != lock_text:
        raise ELFError(f"--out {out} is not shared between the nodes: this node does not see the lock that rank 0 "
                       f"(host {host0}) holds in it ({(out / FolderLock.NAME).absolute()} is "
                       f"{'missing' if seen is None else 'another'} here). A run on several nodes needs a run "
                       "folder on a filesystem that every node mounts at the same path (NFS, Lustre, GPFS, ...)")


def claim_run(folder: RunFolder, cfg: TrainConfig, world: int, resume: bool, overwrite: bool, device=None) -> dict:
    """Rank 0's decisions about the run folder, which every rank follows: hold it (lock, clean-up), check
    what --resume / --overwrite may do with it (a stored dtype "auto" read as what it picks on `device`),
    resolve the micro-batch (the stored run's on --resume) and choose the checkpoint to resume from. Returns
    them with the lock's text (for `shared_folder_check`)."""
    import socket

    out = folder.out
    check_output(out, folder=True)
    folder.open()
    check_run_dir(out, cfg, resume, overwrite, device)
    folder.fresh = not resume and not (out / RUN_FILE).exists()
    stored, read_warnings = None, []
    if resume and (out / RUN_FILE).exists():
        with warnings.catch_warnings(record=True) as read_warnings:  # shown once the resume is not refused
            stored = run_file(out)
    micro = micro_batch_for(cfg, world, stored)
    before = (stored["train"] or {}).get("micro_batch") if stored else None
    ckpt, state = resume_point(out, stored) if resume else (None, None)
    if state is not None:
        check_steps_left(out, state["step"], cfg)
    check_writable(out)
    for w in read_warnings:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if before and before != micro:
        print(f"warning: continuing with --micro-batch {micro} instead of the run's {before}: from here on the "
              "run draws other noise than an uninterrupted run would", file=sys.stderr)
    return {"micro_batch": micro, "checkpoint": None if ckpt is None else ckpt.name, "state": state,
            "lock": FolderLock.text(out), "host": socket.gethostname()}


def check_steps_left(out: Path, step: int, cfg: TrainConfig) -> None:
    """A --resume whose --steps the run has already passed (its checkpoint is at `step`) changes nothing:
    ELFError saying so."""
    if cfg.epochs is not None:
        return
    if step > cfg.steps:
        raise ELFError(f"{out} is already at step {step}, past --steps {cfg.steps}; nothing was changed. Pass a "
                       f"--steps above {step} to train further")


def check_writable(out: Path) -> None:
    """The run folder and its checkpoints/ take new files (an immutable or read-only checkpoints/ is found
    before any step is trained)."""
    for folder in (out, out / CHECKPOINTS):
        if folder.is_dir():
            try:
                probe_writable(folder)
            except OSError as e:
                raise ELFError(f"{folder}: cannot write in it ({e.strerror or e}); nothing was trained. Make it "
                               "writable, then run again") from None


def check_not_inside(out, path, flag: str) -> None:
    """Refuse an --out that lies inside a run folder holding `path` (the run of `flag`): a command's output
    goes into a folder of its own, never among another run's files (whose --overwrite would take them)."""
    out = resolved(out)
    for run in run_folders_holding(path):
        if run in out.parents:
            raise ELFError(f"--out {out} lies inside {run}, the run folder of {flag} {path}; the output must go "
                           "into a folder of its own, outside that run: choose another --out")
