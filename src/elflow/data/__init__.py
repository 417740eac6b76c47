"""Data: text sources and the built-in corpus, layouts of token rows, the token store, preparing a store, the
data sets read from stores, and the batches of a run."""
