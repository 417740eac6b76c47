"""elflow: ELF (Embedded Language Flows) in PyTorch.

Flow matching in the embedding space of a frozen encoder, with one transformer that denoises whole
passages and, at the last step, reads them out as tokens.
"""

__version__ = "0.1.0"
