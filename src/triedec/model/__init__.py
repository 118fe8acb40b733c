"""The model: loading sources, the adapter over transformers, triedec's kernels and precision modes."""
