"""The examples, importable as a package (``examples.train_gpt_varlen``) by benchmarks that train their
models; each example still runs as a file (``torchrun ... examples/train_mlp.py``)."""
