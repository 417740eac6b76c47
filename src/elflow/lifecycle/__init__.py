"""A run's lifecycle, above the files that store it (elflow.runs) and the training config (elflow.config):
the trainer's hold on its folder and what --resume and --overwrite may do (claim), the decoder stage of a
--decoder separate run (stages), where a command writes its files (outputs) and `elflow push`."""
