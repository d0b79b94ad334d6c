"""Pretrained Llama-family checkpoints (GGUF files, Hugging Face safetensors folders) loaded
into the dosa Transformer, with their tokenizers and their trained DSA indexers."""

from model.pretrained.indexer_weights import (
    has_indexer_weights,
    load_indexer_weights,
    save_indexer_weights,
)
from model.pretrained.llama import (
    LlamaHParams,
    PretrainedFormatError,
    build_transformer,
    hf_tensor_shapes,
    llama_config,
)
from model.pretrained.registry import (
    PRETRAINED,
    Pretrained,
    PretrainedFetchError,
    cache_dir,
    fetch_pretrained,
    file_sha256,
    load_pretrained,
    open_checkpoint,
)
from model.pretrained.tokenizer import ByteTokenizer, HFTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "LlamaHParams", "PRETRAINED", "Pretrained",
           "PretrainedFetchError", "PretrainedFormatError", "build_transformer", "cache_dir",
           "fetch_pretrained", "file_sha256", "has_indexer_weights", "hf_tensor_shapes",
           "llama_config", "load_indexer_weights", "load_pretrained", "open_checkpoint",
           "save_indexer_weights"]
