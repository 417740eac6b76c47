"""The files of a run, below the training config: its record, the chain that makes an earlier layout today's,
checkpoints, the one loader, the released format, model folders, the run's log and figures and W&B. What a run
does with them (its folder's claim, its stages, outputs, push) is elflow.lifecycle."""
