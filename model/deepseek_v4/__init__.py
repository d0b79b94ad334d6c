"""DeepSeek-V4's parts that no other family has (transformers 5.23's `deepseek_v4`, the
reference they are checked against): manifold-constrained hyper-connections
(hyper_connections.py) and the compressors that turn windows of tokens into the entries
CSA and HCA layers attend to (compressor.py). Pure functions over arrays: the modules that
own the parameters build on them."""
