"""elflow: ELF (Embedded Language Flows) in PyTorch.

Flow matching in the embedding space of a frozen encoder, with one transformer that denoises whole passages
and, at the last step, reads them out as tokens. `elflow.load(path_or_hub_id)` gives a trained network with
its description, `net.record` (an `elflow.RunRecord`); examples/nano_elf.py holds the whole method in one
file; docs/internals.md reads the package module by module.
"""

__version__ = "0.1.0"


def load(path_or_hub_id, device=None, max_length=None):
    """The network of an elflow run, checkpoint or model folder (what `elflow push` writes), of a Hub model that
    `elflow push` uploaded (its hub id), or of a released checkpoint (a checkpoint_<step> file, a folder holding
    one, or a hub id such as embedded-language-flows/ELF-B-owt-torch), with its EMA weights, in eval mode;
    `net.record` is its RunRecord, `net.origin` where its weights came from."""
    from elflow.runs.load import load as _load

    return _load(path_or_hub_id, device=device, max_length=max_length)


def __getattr__(name):
    if name == "RunRecord":  # imported on first use: `import elflow` stays light
        from elflow.runs.record import RunRecord

        return RunRecord
    raise AttributeError(f"module 'elflow' has no attribute {name!r}")
