"""Runs on disk: checkpoints, the run folder's rules, the one loader, the released format, model folders, the
decoder stage, the run's log and figures, W&B and `elflow push`."""
